"""Attention over squeeze's quantized KV cache through the native kernel: one kernel for ``squeeze run`` and
``squeeze serve``.

``squeeze serve`` attends a whole ragged step per layer with squeeze.runtime.kernels.cpu_attention, reading
the paged pool's codes in place (squeeze.serve.engine.runner). A request's greedy text must equal what ``squeeze
run`` gives it alone, so ``squeeze run`` attends through the same kernel whenever serve would:
:func:`native_kernels` is the one decision for both (the model, not the call, decides), and :func:`native_run`
switches a run over a :class:`SqueezeKVCache` to it. The kernel's result for a row depends on nothing but that
row (not the batch, the thread count, the instruction set or how a prompt is chunked), so the texts agree.

Everything else keeps transformers' SDPA over the dequantized history: perplexity through the cache,
``model.generate``, full-precision caches (squeeze run's DynamicCache and serve's 16-bit pool).
``SQUEEZE_NATIVE_ATTENTION=0`` turns the kernel off for both (today's SDPA path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from squeeze.runtime.kernels.cpu_attention import AttentionKernels, RaggedRows, attend, attention_kernels
from squeeze.runtime.quantized_cache import SqueezeKVCache, SqueezeKVLayer
from squeeze.runtime.stored_dtype import compute_dtype

#: "0" turns the native attention off (squeeze run and squeeze serve alike).
ENV = "SQUEEZE_NATIVE_ATTENTION"
#: The attention implementation squeeze run registers with transformers while a run attends natively.
RUN_ATTENTION = "squeeze_native"


def native_kernels(model: nn.Module) -> AttentionKernels | None:
    """The kernel squeeze run and squeeze serve attend with over a quantized KV cache of ``model``, or None
    (then both run SDPA): off by ``SQUEEZE_NATIVE_ATTENTION=0``, for a model that is not float32 on the CPU,
    for attention the kernel does not compute (sliding windows, logit soft-capping), without a compiler."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) for name in ("sliding_window", "attn_logit_softcapping")):
        return None
    param = next(iter(model.parameters()), None)
    # the dtype decided at load, not the first parameter's: that is the embedding, kept as stored (float16)
    if param is None or compute_dtype(model) != torch.float32 or param.device.type != "cpu":
        return None
    return attention_kernels()


def scaling_of(module: nn.Module, head_dim: int, scaling: float | None) -> float:
    """The softmax scale transformers passes (else the module's, else 1/sqrt(head_dim))."""
    if scaling is not None:
        return float(scaling)
    return float(getattr(module, "scaling", head_dim**-0.5))


class RunAttention:
    """What each forward of a native squeeze run passes as ``squeeze_kv``: the cache, and per batch row the
    left padding its keys skip (``key_start (B,)`` int64)."""

    def __init__(self, kernels: AttentionKernels, cache: SqueezeKVCache, key_start: Tensor):
        self.kernels = kernels
        self.cache = cache
        self.key_start = key_start.to("cpu", torch.int64).contiguous()
        self._rows: dict[tuple[int, int, int, int], RaggedRows] = {}

    def attend(self, module: nn.Module, query: Tensor, scaling: float | None) -> Tensor:
        """``query (B, Hq, T, D)`` against layer ``module.layer_idx``'s history; (B, T, Hq, D)."""
        layer = self.cache.layers[module.layer_idx]  # type: ignore[index]
        assert isinstance(layer, SqueezeKVLayer)
        batch, hq, new, d = query.shape
        stores = layer.kernel_stores()
        rows = self._ragged(layer, batch, new)
        flat = query.transpose(1, 2).reshape(batch * new, hq, d)
        kv_heads = layer.kv_heads
        out = attend(self.kernels, flat, kv_heads, rows, *stores, scaling_of(module, d, scaling))
        return out.view(batch, new, hq, d)

    def _ragged(self, layer: SqueezeKVLayer, batch: int, new: int) -> RaggedRows:
        """Row b: its ``new`` queries, its history of the layer's length; sink tokens from the sink tensors,
        the rest from stream token ``p - sink`` of batch row b (same for every layer of one forward)."""
        length, sink, capacity = layer.get_seq_length(), layer.sink_length, layer.capacity
        key = (batch, new, length, capacity)
        if key not in self._rows:
            heads = layer.kv_heads
            p = torch.arange(length)
            b = torch.arange(batch)[:, None]
            slots = (b * heads * capacity + (p - sink).clamp(min=0)).reshape(-1)
            sink_of = torch.where(p < sink, b * heads * sink + p, -1).reshape(-1) if sink else None
            self._rows = {
                key: RaggedRows(
                    torch.arange(batch + 1) * new,
                    torch.arange(batch + 1) * length,
                    slots.contiguous(),
                    sink_of.contiguous() if sink_of is not None else None,
                    self.key_start,
                )
            }
        return self._rows[key]


def run_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    squeeze_kv: RunAttention | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function of a native run: the kernel with ``squeeze_kv``, else plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if squeeze_kv is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    return squeeze_kv.attend(module, query, kwargs.get("scaling")), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RUN_ATTENTION, run_attention)
    AttentionMaskInterface.register(RUN_ATTENTION, sdpa_mask)


@contextmanager
def native_run(model: nn.Module, cache: object, attention_mask: Tensor) -> Iterator[dict[str, Any]]:
    """Within: ``model``'s forwards over ``cache`` attend natively when :func:`native_kernels` says so (a
    :class:`SqueezeKVCache` and an SDPA model), given the yielded keyword arguments; else nothing changes and
    nothing is yielded. ``attention_mask (B, T)``: the prompt batch's, left-padded."""
    config: Any = getattr(model, "config", None)
    kernels = native_kernels(model) if isinstance(cache, SqueezeKVCache) else None
    if kernels is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield {}
        return
    assert isinstance(cache, SqueezeKVCache)
    _register()
    key_start = attention_mask.long().argmax(dim=1)  # each row's left padding: the first 1 (0 without padding)
    config._attn_implementation = RUN_ATTENTION
    cache.set_native(True)
    try:
        yield {"squeeze_kv": RunAttention(kernels, cache, key_start)}
    finally:
        config._attn_implementation = "sdpa"
        cache.set_native(False)


__all__ = ["ENV", "RUN_ATTENTION", "RunAttention", "native_kernels", "native_run", "run_attention", "scaling_of"]
