"""A flat forward for the Llama shape: the same operations as transformers' forward, without its module tree.

transformers' forward of a decoder step walks ~10 modules per layer through decorators, output-capturing
hooks, mask construction, the attention-function registry and the cache's dispatch; for a 30-layer model at
one token that Python costs more than the quantized linears themselves (docs/benchmarks/serving.md, the
per-op profile). :func:`fast_forward` computes the same thing with a flat loop over the layers:

    embed -> per layer [RMSNorm; q/k/v (the model's own linear modules); (Qwen3: q/k RMSNorm); rotary (the
    model's own rotary module and apply_rotary_pos_emb); KV write + attention (the caller's ``attend``:
    one native call over squeeze's cache); o_proj; residual; RMSNorm; gate/up, SiLU (F.silu, what
    SiLUActivation computes, called past the hub-kernel wrapper), mul; down; residual]
    -> final RMSNorm -> the LM head on the kept positions only.

Every operation is the one transformers runs, in the same order, on tensors of the same shapes and layouts
(the norms' arithmetic is written out op for op, the rest calls the model's modules and functions), so the
logits are transformers' bits: tests/runtime/test_fast_path.py compares them. Only the Python around the
operations is gone.

:func:`fast_path_supported` is the one predicate (``squeeze run`` and ``squeeze serve`` both ask it, so a
request takes the same path in both): Llama, Mistral, Qwen2, Qwen3 (SmolLM is Llama), SiLU MLPs, RMSNorm,
default or llama3 RoPE, no sliding window, no soft-capping, no tensor-parallel split. Every other family or
configuration keeps transformers' forward. ``SQUEEZE_FAST_PATH=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from squeeze.models.families import takes_fast_path

#: "0" turns the flat forward off (squeeze run and squeeze serve alike): transformers' forward everywhere.
ENV = "SQUEEZE_FAST_PATH"
#: RoPE types whose cos / sin depend on the positions only (the rotary module's own computation is used).
ROPE_TYPES = frozenset({"default", "llama3"})

#: ``attend(attention_module, query (B, Hq, T, D), key (B, Hkv, T, D), value (B, Hkv, T, D))``: store the new
#: keys / values in the caller's cache and attend; returns (B, T, Hq, D) float32.
AttendFn = Callable[[nn.Module, Tensor, Tensor, Tensor], Tensor]


def fast_path_supported(model: nn.Module) -> bool:
    """Whether :func:`fast_forward` computes ``model``'s forward (else transformers' forward stays)."""
    if os.environ.get(ENV, "1").strip() == "0" or model.training:
        return False
    config: Any = getattr(model, "config", None)
    # the model family says whether its decoder layer is Llama's (squeeze.models.families: Qwen3's q/k norms too)
    if not takes_fast_path(getattr(config, "model_type", None)) or getattr(config, "hidden_act", None) != "silu":
        return False
    if any(getattr(config, name, None) for name in ("sliding_window", "attn_logit_softcapping")):
        return False
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "pretraining_tp", 1) not in (1, None):
        return False
    inner: Any = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if not hasattr(model, "lm_head") or getattr(inner.rotary_emb, "rope_type", None) not in ROPE_TYPES:
        return False
    return _is_rms(inner.norm) and all(_llama_layer(layer) for layer in inner.layers)


def _is_rms(norm: object) -> bool:
    """A Llama-style RMSNorm (``weight * x / rms(x)``, its ``variance_epsilon``): Gemma's (1 + weight) is not."""
    return (
        type(norm).__name__.endswith("RMSNorm")
        and hasattr(norm, "variance_epsilon")
        and "Gemma" not in type(norm).__name__
    )


def _llama_layer(layer: nn.Module) -> bool:
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "head_dim")):
        return False
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    # SiLUActivation / nn.SiLU compute F.silu, called directly (not through the hub-kernel layer wrapper)
    if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]  # type: ignore[union-attr]
    norms += [getattr(attn, name) for name in ("q_norm", "k_norm") if hasattr(attn, name)]
    return all(_is_rms(norm) for norm in norms) and hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")


def _rms_norm(norm: Any, x: Tensor) -> Tensor:
    """LlamaRMSNorm.forward's operations, in order (for float32 ``x``: its two dtype conversions are no-ops)."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * (x if dtype == torch.float32 else x.to(dtype))  # type: ignore[no-any-return]


def fast_forward(
    model: nn.Module, input_ids: Tensor, position_ids: Tensor, attend: AttendFn, keep: int | Tensor = 1
) -> Tensor:
    """Logits of ``input_ids (B, T)`` int64 at ``position_ids (B, T)``: (B, kept, V), as ``model(input_ids,
    position_ids=..., logits_to_keep=keep)`` computes them (``keep``: the last ``keep`` positions, or the
    indices (k,) int64 of the kept ones). ``attend`` stores each layer's keys / values and attends (see
    :data:`AttendFn`); the model must pass :func:`fast_path_supported`."""
    inner: Any = model.model  # type: ignore[union-attr]
    hidden = inner.embed_tokens(input_ids)  # (B, T, H)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # (B, T, D) each
    rotate = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    for layer in inner.layers:
        hidden = hidden + _attention(
            layer.self_attn, _rms_norm(layer.input_layernorm, hidden), cos, sin, rotate, attend
        )
        mlp = layer.mlp
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        hidden = hidden + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    hidden = _rms_norm(inner.norm, hidden)
    index = slice(-keep, None) if isinstance(keep, int) else keep
    return model.lm_head(hidden[:, index, :])  # type: ignore[no-any-return, operator]


def _attention(attn: Any, x: Tensor, cos: Tensor, sin: Tensor, rotate: Callable[..., Any], attend: AttendFn) -> Tensor:
    """LlamaAttention.forward (Qwen3's with its q / k norms): ``x (B, T, H)`` -> o_proj's (B, T, H)."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    query, key = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
    if hasattr(attn, "q_norm"):
        query, key = _rms_norm(attn.q_norm, query), _rms_norm(attn.k_norm, key)
    value = attn.v_proj(x).view(shape).transpose(1, 2)
    query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)  # (B, H, T, D)
    out = attend(attn, query, key, value)  # (B, T, Hq, D)
    return attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())  # type: ignore[no-any-return]


__all__ = ["ENV", "ROPE_TYPES", "AttendFn", "fast_forward", "fast_path_supported"]
