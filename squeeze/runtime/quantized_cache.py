"""A quantized KV cache (int8 / packed int4, or fp8) that transformers' ``generate`` and plain forwards accept.

Per layer, the first ``sink_tokens`` tokens (the attention sink) are kept as given; every later token is
stored as codes on a per-token grid: keys after a per-channel normalisation calibrated by ``squeeze
calibrate-kv`` (none in the uncalibrated baseline; with a rotating centre where calibrated, which depends on the
token's position in the cache: sink included, from 0), values with a calibrated clipping ratio or, at int4, as
indices into a calibrated codebook (see squeeze.quant.kv). An fp8 spec (vLLM's ``kv_cache_dtype="fp8"``)
has no sink and stores every element as float8_e4m3fn(x / scale) with the layer's calibrated scale
(:class:`FP8Codec`), as vLLM's cache does. The history is never kept in floating point:
``update`` dequantizes it into a fresh tensor that lives only for the attention call of that layer, so at
most one layer's float K/V exists at a time.

Keys arrive post-RoPE: since transformers 5, attention modules hand the cache rotated keys and no position
embeddings, so calibration and quantization both work on post-RoPE keys (see docs/guide/calibrate-kv.md).

All new tokens are returned dequantized too, prefill included, so perplexity measured through this cache
sees exactly the error that generation sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from squeeze.quant.kv import (
    PARAM_BYTES,
)
from squeeze.quant.kv_spec import KVSpec, LayerFP8, LayerKV
from squeeze.runtime.kernels.cpu_attention import KVStore, attention_kernels, quantized_store
from squeeze.runtime.kernels.cpu_kv_write import MAX_HEAD_DIM, write_params, write_tokens
from squeeze.runtime.kv_codecs import PARAM_DTYPE, EncodedTokens, FP8Codec, TokenCodec, layer_codecs


class QuantizedStream:
    """The codes of one tensor (keys or values) of one layer, (B, H, T, D), in buffers that grow by doubling.

    Token ``i`` of the stream sits at cache position ``origin + i`` (``origin``: the sink tokens before it).
    """

    def __init__(self, codec: TokenCodec, origin: int = 0):
        self.codec = codec
        self.origin = origin
        self.length = 0
        self.codes: Tensor | None = None  # (B, H, cap, D) int8 / uint8, or (B, H, cap, D/2) uint8 packed int4
        self.scale: Tensor | None = None  # (B, H, cap, G) fp16, G grids per token
        self.offset: Tensor | None = None  # (B, H, cap, G) fp16, asymmetric grids only

    def append(self, x: Tensor) -> None:
        """Quantize ``x (B, H, n, D)`` and append it."""
        n = x.shape[-2]
        if n == 0:
            return
        if self._append_natively(x):
            self.length += n
            return
        encoded = self.codec.encode(x, self._positions(self.length, n, x.device))
        self._reserve(x, self.length + n, encoded.codes.dtype, groups=encoded.scale.shape[-1])
        assert self.codes is not None and self.scale is not None
        end = self.length + n
        self.codes[:, :, self.length : end] = encoded.codes
        self.scale[:, :, self.length : end] = encoded.scale
        if self.offset is not None and encoded.offset is not None:
            self.offset[:, :, self.length : end] = encoded.offset
        self.length = end

    def _append_natively(self, x: Tensor) -> bool:
        """Quantize ``x (B, H, n, D)`` straight into the buffers with the native write (squeeze.runtime.kernels.
        cpu_kv_write: the codec's bytes), one call per batch row; False (nothing done) where it does not apply."""
        b, h, n, d = x.shape
        usable = x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and d <= MAX_HEAD_DIM
        kernels = attention_kernels() if usable else None
        params = write_params(self.codec, h) if kernels is not None else None
        if kernels is None or params is None:
            return False
        self._reserve(x, self.length + n, self.codec.code_dtype, groups=self.codec.groups(d))
        assert self.codes is not None and self.scale is not None
        capacity = self.codes.shape[2]
        store = quantized_store(
            self.codec,
            self.codes,
            self.scale,
            self.offset,
            None,
            head_stride=capacity,
            sink_head_stride=0,
            positions=self.origin + self.length + n,
        )
        if store is None:
            return False
        steps = torch.arange(self.length, self.length + n)
        positions = steps + self.origin if self.codec.rotation is not None else None
        for row in range(b):  # token t of row b: slot b * H * capacity + t (head stride: capacity)
            if not write_tokens(kernels, params, store, x[row], steps + row * h * capacity, positions):
                raise RuntimeError("the native KV write refused a float32 CPU tensor")  # checked above
        return True

    def dequantize_into(self, out: Tensor) -> None:
        """Write the dequantized history into ``out (B, H, length, D)`` (any float dtype, may be a view)."""
        if self.length == 0:
            return
        assert self.codes is not None and self.scale is not None
        offset = self.offset[:, :, : self.length] if self.offset is not None else None
        positions = self._positions(0, self.length, out.device)
        self.codec.decode_into(self.codes[:, :, : self.length], self.scale[:, :, : self.length], offset, out, positions)

    def _positions(self, start: int, n: int, device: torch.device) -> Tensor | None:
        """Cache positions (n,) int64 of stream tokens ``start..start+n-1``, or None when the codec needs none."""
        if self.codec.rotation is None:
            return None
        return torch.arange(self.origin + start, self.origin + start + n, device=device)

    def nbytes(self) -> int:
        """Bytes of the stored history (codes and per-token params of ``length`` tokens, not spare capacity)."""
        if self.codes is None:
            return 0
        b, h, _, d = self.codes.shape
        params = self.scale.shape[-1] * (1 if self.offset is None else 2) if self.scale is not None else 0
        return b * h * self.length * (d + params * PARAM_BYTES)

    def map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` (e.g. index_select over dim 0) to every per-batch buffer."""
        for name in ("codes", "scale", "offset"):
            buffer = getattr(self, name)
            if buffer is not None:
                setattr(self, name, fn(buffer))

    def _reserve(self, like: Tensor, needed: int, code_dtype: torch.dtype, *, groups: int) -> None:
        capacity = 0 if self.codes is None else self.codes.shape[2]
        if needed <= capacity:
            return
        b, h, _, d = like.shape
        new_capacity = max(needed, 2 * capacity, 64)
        width = self.codec.code_width(d)

        def grow(old: Tensor | None, last: int, dtype: torch.dtype) -> Tensor:
            fresh = torch.empty((b, h, new_capacity, last), dtype=dtype, device=like.device)
            if old is not None:
                fresh[:, :, : self.length] = old[:, :, : self.length]
            return fresh

        self.codes = grow(self.codes, width, code_dtype)
        self.scale = grow(self.scale, groups, PARAM_DTYPE)
        if not self.codec.symmetric:
            self.offset = grow(self.offset, groups, PARAM_DTYPE)


class SqueezeKVLayer(DynamicLayer):
    """One attention layer's quantized cache: a full-precision sink plus quantized keys and values."""

    is_croppable = True

    def __init__(self, bits: int, layer: LayerKV | LayerFP8 | None, sink_tokens: int):
        super().__init__()
        self.bits = bits
        self.spec = layer
        self.sink_tokens = sink_tokens
        self.cumulative_length = 0
        self.native = False  # update returns no history: squeeze.runtime.attention reads the codes in place
        self._reset_storage()

    def _reset_storage(self) -> None:
        keys, values = layer_codecs(self.bits, self.spec)
        self.k_stream = QuantizedStream(keys, origin=self.sink_tokens)
        self.v_stream = QuantizedStream(values, origin=self.sink_tokens)
        self.sink_keys: Tensor | None = None  # (B, H, <= sink_tokens, D), as given
        self.sink_values: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        # transformers reads .keys / .values for device and dtype; the history itself lives in the streams.
        # Fresh empty tensors, not [..., :0, :] views, which would keep the whole prefill's storage alive.
        empty = (*key_states.shape[:-2], 0, key_states.shape[-1])
        self.keys = key_states.new_empty(empty)
        self.values = value_states.new_empty(empty)
        self.sink_keys = key_states.new_empty(empty)
        self.sink_values = value_states.new_empty(empty)
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Store new ``key_states`` / ``value_states (B, H, n, D)``; return the whole history, dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.sink_keys is not None and self.sink_values is not None
        given = key_states, value_states
        room = self.sink_tokens - self.sink_keys.shape[-2]
        if room > 0:
            self.sink_keys = torch.cat([self.sink_keys, key_states[..., :room, :]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, value_states[..., :room, :]], dim=-2)
            key_states, value_states = key_states[..., room:, :], value_states[..., room:, :]
        self.k_stream.append(key_states)
        self.v_stream.append(value_states)
        self.cumulative_length = self.sink_keys.shape[-2] + self.k_stream.length
        if self.native:  # the native attention reads the codes in place (squeeze.runtime.attention)
            return given
        return self._history(self.sink_keys, self.k_stream), self._history(self.sink_values, self.v_stream)

    @property
    def sink_length(self) -> int:
        """Tokens held in the full-precision sink (the first ones; the streams hold the rest)."""
        return self.sink_keys.shape[-2] if self.sink_keys is not None else 0

    @property
    def capacity(self) -> int:
        """Token slots per (batch row, head) of the streams' buffers (0 before any token beyond the sink)."""
        return self.k_stream.codes.shape[2] if self.k_stream.codes is not None else 0

    @property
    def kv_heads(self) -> int:
        return self.sink_keys.shape[1] if self.sink_keys is not None else 0

    def kernel_stores(self) -> tuple[KVStore, KVStore]:
        """Keys and values as the native attention kernel reads them in place: stream token ``t`` of batch row
        ``b`` and head ``h`` at slot ``(b * H + h) * capacity + t`` (head stride ``capacity``), sink token ``p`` at
        entry ``(b * H + h) * sink_length + p``. ValueError for a cache the kernel does not read."""
        stores = []
        for sink, stream in ((self.sink_keys, self.k_stream), (self.sink_values, self.v_stream)):
            assert sink is not None
            codes, scale, offset = stream.codes, stream.scale, stream.offset
            if codes is None or scale is None:  # every token so far is a sink token: nothing else is read
                width, groups = stream.codec.code_width(sink.shape[-1]), stream.codec.groups(sink.shape[-1])
                codes = torch.zeros((1, width), dtype=stream.codec.code_dtype)
                scale = torch.zeros((1, groups), dtype=PARAM_DTYPE)
                offset = None if stream.codec.symmetric else scale
            store = quantized_store(
                stream.codec,
                codes,
                scale,
                offset,
                sink.contiguous() if sink.shape[-2] else None,
                head_stride=self.capacity,
                sink_head_stride=sink.shape[-2],
                positions=self.cumulative_length,
            )
            if store is None:
                raise ValueError(f"the native attention does not read a {type(stream.codec).__name__} cache")
            stores.append(store)
        return stores[0], stores[1]

    def _history(self, sink: Tensor, stream: QuantizedStream) -> Tensor:
        b, h, s, d = sink.shape
        out = torch.empty((b, h, s + stream.length, d), dtype=self.dtype, device=self.device)  # (B, H, T, D)
        out[:, :, :s] = sink
        stream.dequantize_into(out[:, :, s:])
        return out

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes this layer holds: sink tensors plus quantized codes and per-token params."""
        sink = sum(t.numel() * t.element_size() for t in (self.sink_keys, self.sink_values) if t is not None)
        return sink + self.k_stream.nbytes() + self.v_stream.nbytes()

    def reset(self) -> None:
        self.cumulative_length = 0
        self.keys = self.values = None
        self.is_initialized = False
        self._reset_storage()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count), as speculative
        decoding drops rejected drafts; their codes stay in the buffers until the next tokens overwrite them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, found {tokens_to_remove}")
        remove = min(-tokens_to_remove, self.cumulative_length)
        if remove == 0 or not self.is_initialized:
            return
        assert self.sink_keys is not None and self.sink_values is not None
        from_stream = min(remove, self.k_stream.length)
        self.k_stream.length -= from_stream
        self.v_stream.length -= from_stream
        keep = self.sink_keys.shape[-2] - (remove - from_stream)
        self.sink_keys, self.sink_values = self.sink_keys[..., :keep, :], self.sink_values[..., :keep, :]
        self.cumulative_length = self.sink_keys.shape[-2] + self.k_stream.length

    def _map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        if not self.is_initialized:
            return
        self.sink_keys = fn(self.sink_keys)  # type: ignore[arg-type]
        self.sink_values = fn(self.sink_values)  # type: ignore[arg-type]
        self.keys, self.values = fn(self.keys), fn(self.values)  # type: ignore[arg-type]
        self.k_stream.map_batch(fn)
        self.v_stream.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])


class SqueezeKVCache(Cache):
    """A transformers Cache whose layers store int8 / int4 codes or fp8 (see the module docstring).

    ``spec`` comes from an artifact calibrated by ``squeeze calibrate-kv`` (:func:`kv_spec_from_artifact`)
    or is :meth:`KVSpec.dynamic` for the uncalibrated per-token baseline. Create a fresh cache per
    sequence batch (as with DynamicCache).
    """

    def __init__(self, spec: KVSpec):
        super().__init__(layers=[SqueezeKVLayer(spec.bits, layer, spec.sink_tokens) for layer in spec.layers])
        self.spec = spec

    def set_native(self, native: bool) -> None:
        """While ``native``, ``update`` stores the new tokens and returns them as given, not the dequantized
        history (the native attention reads the codes in place: squeeze.runtime.attention)."""
        for layer in self.layers:
            if isinstance(layer, SqueezeKVLayer):
                layer.native = native

    def nbytes(self) -> int:
        """Bytes of the whole cache as held now (all layers)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, SqueezeKVLayer))


__all__ = [
    "EncodedTokens",
    "TokenCodec",
    "FP8Codec",
    "layer_codecs",
    "QuantizedStream",
    "SqueezeKVLayer",
    "SqueezeKVCache",
]
