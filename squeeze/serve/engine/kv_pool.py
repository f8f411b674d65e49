"""The paged KV cache: one pool per layer of fixed-size token blocks, written and read through block tables.

Storage is token slots: slot ``block * block_size + i`` is token ``i`` of ``block``. Per layer, keys and
values each hold, over all slots:

- quantized (int8 / int4): ``codes (H, S, D or D/2)`` and per-token grid parameters ``scale`` (and
  ``offset`` for asymmetric value layers) ``(H, S, G)`` fp16: exactly what ``squeeze run``'s contiguous
  cache stores per token (squeeze.runtime.kv_codecs.TokenCodec encodes and decodes both), so a sequence's
  history reads back bit for bit the same whichever blocks hold it. The first ``sink_tokens`` tokens of
  every sequence (the attention sink) are also kept as given, in a small full-precision area with one
  entry per sequence slot (a sequence holds one while it runs).
- full precision (``kv_bits`` 16): the keys and values as given, in the model's dtype, no sink area.

The pool knows nothing of sequences: the engine's block manager hands out blocks, and each step passes a
:class:`StepSlots` (where this step's new tokens go, which slots its rows read) to :meth:`PagedKVPool.update`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.errors import ConfigError
from squeeze.quant.kv_bytes import fp_bytes_per_token
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.kernels.cpu_attention import KVStore, attention_kernels, full_store, quantized_store
from squeeze.runtime.kernels.cpu_kv_write import write_params, write_tokens
from squeeze.runtime.quantized_cache import TokenCodec, layer_codecs

_PARAM_DTYPE = torch.float16  # per-token scales / offsets, as in squeeze run's cache


@dataclass(frozen=True)
class AttentionShape:
    """What every attention layer caches per token: ``kv_heads`` heads of ``head_dim`` channels."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StepSlots:
    """Where one step's tokens go and what attention reads, as int64 index tensors on the pool's device.

    A step's rows are packed into one sequence of N new tokens, and their histories into one of K tokens
    (row after row, each from its position 0; squeeze.serve.engine.runner). ``new_slots`` (N,): the token slot of
    each new token. ``new_sink_tokens`` / ``new_sink_entries`` (m,): which of the new tokens are sink tokens,
    and their index in the sink area. ``read_slots`` (K,): the slot of each history token.
    ``sink_positions`` / ``sink_entries`` (s,): where in the K history tokens a sink token sits, and its
    index in the sink area. ``new_positions`` (N,) / ``read_positions`` (K,): each new / history token's position
    in its sequence (from 0), which a rotating key centre needs (squeeze.quant.kv.KeyRotation); None when the
    pool's cache has none.
    """

    new_slots: Tensor
    new_sink_tokens: Tensor
    new_sink_entries: Tensor
    read_slots: Tensor
    sink_positions: Tensor
    sink_entries: Tensor
    new_positions: Tensor | None = None
    read_positions: Tensor | None = None


class _QuantizedLayerTensor:
    """Keys or values of one layer in a quantized pool: codes and grid parameters for every slot."""

    def __init__(
        self,
        codec: TokenCodec,
        shape: AttentionShape,
        slots: int,
        sink_entries: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        h, d = shape.kv_heads, shape.head_dim
        self.codec = codec
        # zeros: slots never written (padding reads) decode to finite numbers
        self.codes = torch.zeros((h, slots, codec.code_width(d)), dtype=codec.code_dtype, device=device)
        self.scale = torch.zeros((h, slots, codec.groups(d)), dtype=_PARAM_DTYPE, device=device)
        self.offset = None if codec.symmetric else torch.zeros_like(self.scale)
        self.sink = torch.zeros((h, sink_entries, d), dtype=dtype, device=device)
        self._store: KVStore | None = None
        self._store_positions = 0

    def write(self, new: Tensor, slots: StepSlots) -> None:
        """Store ``new (H, N, D)``: its codes into ``slots.new_slots``, sink tokens as given."""
        if not self._write_natively(new, slots):
            encoded = self.codec.encode(new[None], slots.new_positions)  # (1, H, N, D) -> codes (1, H, N, Dc)
            self.codes.index_copy_(1, slots.new_slots, encoded.codes[0])
            self.scale.index_copy_(1, slots.new_slots, encoded.scale[0].to(_PARAM_DTYPE))
            if self.offset is not None and encoded.offset is not None:
                self.offset.index_copy_(1, slots.new_slots, encoded.offset[0].to(_PARAM_DTYPE))
        if slots.new_sink_tokens.numel():
            kept = new.index_select(1, slots.new_sink_tokens).to(self.sink.dtype)
            self.sink.index_copy_(1, slots.new_sink_entries, kept)

    def _write_natively(self, new: Tensor, slots: StepSlots) -> bool:
        """The codes, scales and offsets of ``new`` written by the native kernel (squeeze.runtime.kernels.
        cpu_kv_write: the torch codec's bytes) when it covers this layer; False: nothing written."""
        if self.codes.device.type != "cpu" or new.dtype != torch.float32 or not slots.new_slots.numel():
            return False
        kernels = attention_kernels()
        params = write_params(self.codec, self.codes.shape[0]) if kernels is not None else None
        if kernels is None or params is None:
            return False
        positions = slots.new_positions
        needed = int(positions.max()) + 1 if positions is not None else 1
        store = self.kernel_store(needed)
        if store is None:
            return False
        return write_tokens(kernels, params, store, new, slots.new_slots, positions)

    def read(self, slots: StepSlots, dtype: torch.dtype) -> Tensor:
        """The step's histories, (1, H, K, D) in ``dtype``: decoded codes, sink tokens as stored."""
        h, _, d = self.sink.shape
        out = torch.empty((1, h, slots.read_slots.numel(), d), dtype=dtype, device=self.codes.device)

        def gather(store: Tensor) -> Tensor:  # (H, S, X) -> (1, H, K, X)
            return store.index_select(1, slots.read_slots)[None]

        offset = gather(self.offset) if self.offset is not None else None
        self.codec.decode_into(gather(self.codes), gather(self.scale), offset, out, slots.read_positions)
        if slots.sink_positions.numel():
            out[0].index_copy_(1, slots.sink_positions, self.sink.index_select(1, slots.sink_entries).to(dtype))
        return out

    def kernel_store(self, positions: int) -> KVStore | None:
        """The stores as the native attention kernel reads them in place (None: a layout it does not read);
        ``positions``: one more than the largest cache position read. Built once (again when a rotating key
        centre needs its table grown)."""
        if self.codes.device.type != "cpu":
            return None
        if self._store is None or positions > self._store_positions:
            slots = self.codes.shape[1]
            self._store_positions = max(positions, 2 * self._store_positions)
            sink = self.sink if self.sink.dtype == torch.float32 else None
            if sink is None and self.sink.shape[1]:
                return None
            self._store = quantized_store(
                self.codec,
                self.codes,
                self.scale,
                self.offset,
                sink,
                head_stride=slots,
                sink_head_stride=self.sink.shape[1],
                positions=self._store_positions,
            )
        return self._store


class _FullLayerTensor:
    """Keys or values of one layer in a full-precision pool: the tokens as given, one slot each."""

    def __init__(self, shape: AttentionShape, slots: int, dtype: torch.dtype, device: torch.device):
        self.store = torch.zeros((shape.kv_heads, slots, shape.head_dim), dtype=dtype, device=device)

    def write(self, new: Tensor, slots: StepSlots) -> None:
        self.store.index_copy_(1, slots.new_slots, new.to(self.store.dtype))

    def read(self, slots: StepSlots, dtype: torch.dtype) -> Tensor:
        return self.store.index_select(1, slots.read_slots)[None].to(dtype)  # (1, H, K, D)

    def kernel_store(self, positions: int) -> KVStore | None:
        """The store as the native attention kernel reads it in place (float32 only, else None)."""
        if self.store.dtype != torch.float32 or self.store.device.type != "cpu":
            return None
        return full_store(self.store, self.store.shape[1])


def block_bytes(spec: KVSpec | None, shape: AttentionShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of ``block_size`` tokens takes over all layers (keys and values, grid parameters included)."""
    if spec is None:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return block_size * fp_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)
    return block_size * spec.bytes_per_token(shape.kv_heads, shape.head_dim)


def sink_bytes(spec: KVSpec | None, shape: AttentionShape, sequences: int, dtype: torch.dtype) -> int:
    """Bytes of the full-precision sink area for ``sequences`` sequence slots (0 without quantization)."""
    if spec is None:
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sequences * spec.sink_tokens * fp_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, itemsize)


class PagedKVPool:
    """Every layer's keys and values for ``num_blocks`` blocks of ``block_size`` tokens (see the module docstring).

    ``spec``: the quantized cache's spec (None: full precision in ``dtype``). ``sequences``: sequence slots
    of the sink area (the engine's max_num_seqs).
    """

    def __init__(
        self,
        spec: KVSpec | None,
        shape: AttentionShape,
        *,
        num_blocks: int,
        block_size: int,
        sequences: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        if spec is not None and len(spec.layers) != shape.layers:
            raise ValueError(f"the KV spec has {len(spec.layers)} layers, the model {shape.layers}")
        self.spec = spec
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sequences = sequences
        self.dtype = dtype
        self.sink_tokens = spec.sink_tokens if spec is not None else 0
        slots = num_blocks * block_size
        device = torch.device(device)
        self._keys: list[_QuantizedLayerTensor | _FullLayerTensor] = []
        self._values: list[_QuantizedLayerTensor | _FullLayerTensor] = []
        for index in range(shape.layers):
            if spec is None:
                self._keys.append(_FullLayerTensor(shape, slots, dtype, device))
                self._values.append(_FullLayerTensor(shape, slots, dtype, device))
                continue
            keys, values = layer_codecs(spec.bits, spec.layers[index])
            entries = sequences * self.sink_tokens
            self._keys.append(_QuantizedLayerTensor(keys, shape, slots, entries, dtype, device))
            self._values.append(_QuantizedLayerTensor(values, shape, slots, entries, dtype, device))

    @classmethod
    def sized(
        cls,
        spec: KVSpec | None,
        shape: AttentionShape,
        *,
        memory_bytes: int,
        block_size: int,
        sequences: int,
        dtype: torch.dtype,
        min_tokens: int,
        device: torch.device | str = "cpu",
    ) -> PagedKVPool:
        """The pool with as many blocks as ``memory_bytes`` holds (the sink area counted first).

        ConfigError when that is fewer than ``min_tokens`` tokens (one full-context sequence).
        """
        per_block = block_bytes(spec, shape, block_size, dtype)
        sinks = sink_bytes(spec, shape, sequences, dtype)
        num_blocks = max(0, (memory_bytes - sinks) // per_block)
        needed = -(-min_tokens // block_size)
        if num_blocks < needed:
            need = needed * per_block + sinks
            raise ConfigError(
                f"--kv-memory {memory_bytes} bytes holds {num_blocks} KV blocks of {block_size} tokens, but one "
                f"sequence of the full context ({min_tokens} tokens) needs {needed} ({need} bytes with the sink area)",
                hint=f"pass --kv-memory {_mib(need)}MiB or more, or a smaller --max-model-len",
            )
        return cls(
            spec, shape, num_blocks=num_blocks, block_size=block_size, sequences=sequences, dtype=dtype, device=device
        )

    @property
    def bits(self) -> int:
        """16 (full precision), 8 or 4."""
        return self.spec.bits if self.spec is not None else 16

    @property
    def label(self) -> str:
        """The cache's name in reports: "int8", "int4" or "fp8", and for full precision the dtype it holds
        ("float32" for squeeze.load's models: ``--kv-bits 16`` means unquantized, not a 16-bit dtype)."""
        return self.spec.label if self.spec is not None else str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers, keys and values (grid parameters included; the sink area,
        a fixed cost per sequence, is not)."""
        return self.block_bytes // self.block_size

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.spec, self.shape, self.block_size, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds: every block plus the sink area."""
        return self.num_blocks * self.block_bytes + sink_bytes(self.spec, self.shape, self.sequences, self.dtype)

    def update(self, layer: int, keys: Tensor, values: Tensor, slots: StepSlots) -> tuple[Tensor, Tensor]:
        """Store this step's new ``keys`` / ``values (1, H, N, D)`` of ``layer`` (the rows' new tokens, packed)
        and return the rows' histories, (1, H, K, D) each in their dtype, the new tokens included (read back as
        stored, as squeeze run does)."""
        self.write(layer, keys, values, slots)
        return self._keys[layer].read(slots, keys.dtype), self._values[layer].read(slots, values.dtype)

    def write(self, layer: int, keys: Tensor, values: Tensor, slots: StepSlots) -> None:
        """Store this step's new ``keys`` / ``values (1, H, N, D)`` of ``layer`` (nothing read back: the native
        attention kernel reads the stores in place, see :meth:`kernel_stores`)."""
        for states, store in ((keys, self._keys[layer]), (values, self._values[layer])):
            store.write(states[0], slots)

    def kernel_stores(self, layer: int, positions: int) -> tuple[KVStore, KVStore] | None:
        """``layer``'s keys and values as squeeze.runtime.kernels.cpu_attention reads them in place (None when
        the kernel does not read this pool's layout: CPU float32 sink / full-precision tokens only).
        ``positions``: one more than the largest cache position a row reads."""
        keys = self._keys[layer].kernel_store(positions)
        values = self._values[layer].kernel_store(positions)
        return (keys, values) if keys is not None and values is not None else None


def _mib(size: int) -> int:
    return -(-size // (1 << 20))


__all__ = ["AttentionShape", "StepSlots", "PagedKVPool", "block_bytes", "sink_bytes"]
