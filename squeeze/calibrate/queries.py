"""Second moments of the attention queries, per layer and KV head, captured during a calibration pass.

A key's quantization error ``dk`` reaches the model through the attention scores ``q . dk``. Over the
queries that read the cache, the scores' squared error is ``dk^T S dk`` with ``S = E[q q^T]`` (post-RoPE
queries, the ones attention multiplies the cached keys with; with grouped-query attention, the queries of
every head that shares the KV head). squeeze.calibrate.kv_fit.refine_key_scale minimises that weighted error
instead of the keys' plain squared error.

The queries are read by wrapping the model's attention function for the duration of the pass: transformers (>=
5) calls every attention layer through its ``AttentionInterface`` with the rotated query, key and value states,
so a function registered there under its own name sees them for every architecture that uses the interface.
Layers it never sees (an eager-only model, a custom attention) get no moments, and their keys keep the plain
fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: The name the capturing attention function is registered under while a pass runs.
ATTENTION = "squeeze_query_moments"


class QueryMoments:
    """Running sums of ``q q^T`` per attention layer (``layer_idx``) and KV head: float64 (Hkv, D, D) and a token
    count, over every query position from ``skip`` on (the sink positions the key fit leaves out)."""

    def __init__(self, kv_heads: int, skip: int):
        self.kv_heads = kv_heads
        self.skip = skip
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def add(self, layer_idx: int, query: torch.Tensor) -> None:
        """Accumulate ``query (B, Hq, T, D)`` (any float dtype) of layer ``layer_idx``; a query whose head count
        is not a multiple of the KV heads is ignored (that layer keeps the plain fit)."""
        b, hq, t, d = query.shape
        if hq % self.kv_heads or t <= self.skip:
            return
        q = query[:, :, self.skip :].detach().to(torch.float64)  # (B, Hq, T', D)
        # repeat_kv serves query head j * n_rep + r from KV head j: group the queries by the head they read
        q = (
            q.reshape(b, self.kv_heads, hq // self.kv_heads, t - self.skip, d)
            .transpose(0, 1)
            .reshape(self.kv_heads, -1, d)
        )  # (Hkv, B * n_rep * T', D)
        moment = torch.einsum("hnd,hne->hde", q, q).cpu()  # (Hkv, D, D)
        if layer_idx in self.sums:
            self.sums[layer_idx] += moment
        else:
            self.sums[layer_idx] = moment
        self.counts[layer_idx] = self.counts.get(layer_idx, 0) + q.shape[1]

    def result(self, layers: int) -> list[torch.Tensor | None]:
        """Per layer 0..``layers``-1 the mean ``E[q q^T]`` float32 (Hkv, D, D), or None where no query was seen."""
        out: list[torch.Tensor | None] = []
        for i in range(layers):
            total = self.sums.get(i)
            out.append(None if total is None else (total / max(self.counts[i], 1)).to(torch.float32))
        return out


#: The captures running now (innermost last): the registered function serves the innermost one.
_ACTIVE: list[tuple[QueryMoments, Callable[..., Any]]] = []


def _capturing_attention(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    moments, inner = _ACTIVE[-1]
    layer_idx = getattr(module, "layer_idx", None)
    if isinstance(layer_idx, int):
        moments.add(layer_idx, query)
    return inner(module, query, *args, **kwargs)


@contextmanager
def query_moments(model: nn.Module, kv_heads: int, skip: int) -> Iterator[QueryMoments | None]:
    """While the block runs, ``model``'s attention layers also add their queries to the QueryMoments yielded
    (positions from ``skip`` on, grouped by their ``kv_heads`` KV heads); the model's attention implementation
    is restored afterwards. Yields None, capturing nothing, for a model whose attention implementation is not
    one registered with transformers' AttentionInterface (e.g. eager), or a transformers without one."""
    config: Any = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    try:  # the interfaces are transformers >= 4.53's; older versions keep the plain key fit
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        yield None
        return

    if not isinstance(previous, str) or previous not in ALL_ATTENTION_FUNCTIONS or previous == ATTENTION:
        yield None
        return
    inner = ALL_ATTENTION_FUNCTIONS[previous]
    AttentionInterface.register(ATTENTION, _capturing_attention)
    if previous in ALL_MASK_ATTENTION_FUNCTIONS:  # the masks the wrapped function expects
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    moments = QueryMoments(kv_heads, skip)
    _ACTIVE.append((moments, inner))
    config._attn_implementation = ATTENTION
    try:
        yield moments
    finally:
        config._attn_implementation = previous
        _ACTIVE.pop()


__all__ = ["ATTENTION", "QueryMoments", "query_moments"]
