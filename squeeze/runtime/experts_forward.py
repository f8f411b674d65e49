"""transformers' experts interface for quantized MoE layers: the "squeeze" experts forward and its selection.

transformers 5 runs a MoE layer's experts module through a registered experts implementation
(``ExpertsInterface``: "eager", "grouped_mm", ...). Its default reads whole 3-D expert tensors, which a
:class:`~squeeze.runtime.experts.SqueezeExperts` never builds, so the loaders select "squeeze"
(:func:`squeeze_experts_forward`): the families' eager loop over the routed experts, each projection computed
by :meth:`SqueezeExperts.linear` on the packed codes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from squeeze.runtime.experts import SqueezeExperts


def _expert_linear(module: nn.Module, attr: str, e: int, x: Tensor) -> Tensor:
    """Expert ``e``'s projection ``attr`` of x: by SqueezeExperts.linear, or from a plain 3-D parameter."""
    weight = getattr(module, attr)
    if isinstance(weight, SqueezeExperts):
        out = weight.linear(e, x)
    else:  # an expert parameter the artifact keeps unquantized
        out = x @ weight[e] if getattr(module, "is_transposed", False) else F.linear(x, weight[e])
    bias = getattr(module, f"{attr}_bias", None) if getattr(module, "has_bias", False) else None
    return out + bias[e] if bias is not None else out


def squeeze_experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward (the "squeeze" experts implementation) for experts modules holding
    SqueezeExperts: hidden_states (T, H), top_k_index int (T, K), top_k_weights (T, K) -> (T, H).

    The eager loop of the families' own forwards (experts in ascending order, each over the tokens routed to
    it, results weighted and summed by ``index_add_``), with each projection computed by
    :meth:`SqueezeExperts.linear` (the native kernels on the packed codes) instead of through an expert
    matrix; the gate (``_apply_gate``: gpt-oss's clamped, interleaved one), activation and biases are the
    module's own, as transformers' batched forwards read them. Sentinel indices >= E (expert parallelism)
    are skipped.
    """
    experts = int(self.num_experts)  # self: the experts module (an nn.Module of a transformers MoE family)
    gated = getattr(self, "has_gate", True)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = [e for e in torch.unique(top_k_index).tolist() if 0 <= e < experts]
    for e in hit:
        top_k_pos, token_idx = torch.where(top_k_index.T == e)  # the eager forwards' order
        state = hidden_states[token_idx]
        up = _expert_linear(self, "gate_up_proj" if gated else "up_proj", e, state)
        act = self._apply_gate(up) if gated else self.act_fn(up)
        out = _expert_linear(self, "down_proj", e, act)
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


@functools.cache
def experts_implementation() -> str:
    """The experts implementation the loaders select: "squeeze" (:func:`squeeze_experts_forward`, registered
    with transformers' ExpertsInterface on the first call), or "eager" for a transformers without that registry
    (its experts modules then index the parameter, which works too). transformers is imported here, not at
    module import."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # pragma: no cover - older transformers (e.g. vLLM's pin) keep experts as linears
        return "eager"
    ExpertsInterface.register("squeeze", squeeze_experts_forward)
    return "squeeze"


def use_squeeze_experts(model: nn.Module) -> None:
    """Make every experts module holding a SqueezeExperts run :func:`squeeze_experts_forward` (transformers'
    grouped forward, its default, reads whole 3-D tensors)."""
    for module in model.modules():
        if any(isinstance(child, SqueezeExperts) for child in module.children()):
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "_experts_implementation", None) != experts_implementation():
                config._experts_implementation = experts_implementation()


__all__ = ["squeeze_experts_forward", "experts_implementation", "use_squeeze_experts"]
