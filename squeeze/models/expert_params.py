"""Routed experts stored as 3-D parameters (transformers 5 MoE models), seen as the matrices squeeze quantizes.

transformers 5 keeps a MoE layer's routed experts in one experts module (a class decorated with
``transformers.integrations.moe.use_experts_implementation``, which sets ``is_transposed`` / ``has_bias`` /
``is_concatenated`` on the instance) with one 3-D ``nn.Parameter`` per projection: ``gate_up_proj`` and
``down_proj`` of shape (E, out, in) (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE), or (E, in, out) when
``is_transposed`` (gpt-oss, whose ``*_bias`` parameters stay unquantized).

squeeze quantizes such a parameter as ONE matrix of shape (E*out, in): rows ``e*out .. (e+1)*out - 1`` are
expert ``e``'s output rows, so a per-row format (one LUT per row, RTN scales per row, sparse CSR rows) gives
one LUT per (expert, output row). Its Fisher is reshaped the same way. The artifact names it by its parameter
path (``model.layers.1.mlp.experts.gate_up_proj``, no ``.weight``) and its module entry carries
``"experts": E`` and ``"transposed": bool`` beside the format's own spec (docs/format.md).

Which 3-D parameter names hold projection matrices is the model families' (squeeze.models.families.
expert_param_names; biases never match). Experts modules whose class is not decorated (their layout cannot be
known without running their code) are not found here: their parameters stay unquantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from squeeze.models.families import expert_param_names


class ExpertWeight:
    """One 3-D expert parameter (``module.<attr>``) seen as the (E*out, in) matrix squeeze quantizes.

    ``weight`` is the parameter itself (so Fisher accumulation hooks it like a linear's weight); the matrix
    view is a copy (``matrix()``). Not an nn.Module: it adds nothing to the model.
    """

    __slots__ = ("module", "attr")

    def __init__(self, module: nn.Module, attr: str) -> None:
        self.module = module
        self.attr = attr

    @property
    def weight(self) -> torch.Tensor:
        """The 3-D parameter: (E, out, in), or (E, in, out) when ``transposed``."""
        param = getattr(self.module, self.attr)
        if not isinstance(param, torch.Tensor):  # pragma: no cover - found as a parameter by find_expert_weights
            raise TypeError(f"{type(self.module).__name__}.{self.attr} is not a tensor")
        return param

    @property
    def transposed(self) -> bool:
        """Whether the parameter is stored (E, in, out) (gpt-oss) rather than (E, out, in)."""
        return bool(getattr(self.module, "is_transposed", False))

    @property
    def experts(self) -> int:
        return int(self.weight.shape[0])

    @property
    def expert_rows(self) -> int:
        """Output rows of one expert (``out``)."""
        return int(self.weight.shape[2] if self.transposed else self.weight.shape[1])

    @property
    def columns(self) -> int:
        """Input features (``in``) of every expert."""
        return int(self.weight.shape[1] if self.transposed else self.weight.shape[2])

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(E*out, in): the shape squeeze quantizes."""
        return self.experts * self.expert_rows, self.columns

    def matrix(self) -> torch.Tensor:
        """The parameter as a detached fp32 (E*out, in) matrix (a copy)."""
        return stack_experts(self.weight.detach().float(), self.transposed)

    def stack(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` shaped like the parameter (e.g. its Fisher) as the (E*out, in) matrix."""
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"expected a tensor of shape {tuple(self.weight.shape)}, found {tuple(tensor.shape)}")
        return stack_experts(tensor, self.transposed)

    def __repr__(self) -> str:
        return f"ExpertWeight({type(self.module).__name__}.{self.attr}, {tuple(self.weight.shape)})"


def stack_experts(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """(E, out, in) -> (E*out, in); with ``transposed``, (E, in, out) -> (E*out, in). Rows ``e*out ..`` are
    expert ``e``'s output rows."""
    if param.ndim != 3:
        raise ValueError(f"expected a 3-D expert parameter, found shape {tuple(param.shape)}")
    experts = param.shape[0]
    per_expert = param.transpose(1, 2) if transposed else param
    return per_expert.reshape(experts * per_expert.shape[1], per_expert.shape[2])


def unstack_experts(matrix: torch.Tensor, experts: int, transposed: bool) -> torch.Tensor:
    """The inverse of :func:`stack_experts`: (E*out, in) -> (E, out, in), or (E, in, out) with ``transposed``."""
    if matrix.ndim != 2 or experts < 1 or matrix.shape[0] % experts:
        raise ValueError(f"cannot split a matrix of shape {tuple(matrix.shape)} into {experts} experts")
    per_expert = matrix.reshape(experts, matrix.shape[0] // experts, matrix.shape[1])
    return per_expert.transpose(1, 2) if transposed else per_expert


def expert_count(module: nn.Module) -> int:
    """The number of experts of an experts module: dim 0 of its 3-D projection parameters (0 when it has none)."""
    for name in expert_param_names():
        param = module._parameters.get(name)
        if param is not None and param.ndim == 3:
            return int(param.shape[0])
    return 0


def per_expert_parameters(module: nn.Module) -> list[str]:
    """The experts module's parameters cut per expert: its 3-D projections and their (E, out) biases (every
    direct parameter whose dim 0 is the expert count)."""
    count = expert_count(module)
    return [name for name, p in module.named_parameters(recurse=False) if count and p.ndim >= 2 and p.shape[0] == count]


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (its class decorated with use_experts_implementation)."""
    return isinstance(getattr(module, "is_transposed", None), bool) and isinstance(
        getattr(module, "has_bias", None), bool
    )


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, ExpertWeight]]:
    """Every 3-D projection parameter of every experts module, ``(parameter path, ExpertWeight)``, in model order."""
    for module_name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        for attr, param in module.named_parameters(recurse=False):
            if attr in expert_param_names() and param.ndim == 3:
                yield (f"{module_name}.{attr}" if module_name else attr), ExpertWeight(module, attr)


def expert_modules(targets: Mapping[str, object]) -> dict[str, ExpertWeight]:
    """One ExpertWeight per experts module among ``targets`` ({experts module name: one of its parameters}):
    what counts the (layer, expert) pairs of a model."""
    found: dict[str, ExpertWeight] = {}
    for name, target in targets.items():
        if isinstance(target, ExpertWeight):
            found.setdefault(name.rpartition(".")[0], target)
    return found


def unrouted_experts(
    fisher: Mapping[str, torch.Tensor], targets: Mapping[str, object]
) -> tuple[dict[str, list[int]], int]:
    """Experts calibration never reached: ``({experts module name: [expert ids]}, experts counted)``.

    An expert is unrouted when the Fisher of every quantized parameter of its module is all zero on its
    slice (no calibration token was routed to it, so no gradient reached it). ``fisher``: name -> Fisher
    shaped like the parameter (E, ., .) or already stacked (E*out, in); ``targets``: name -> target (only the
    ExpertWeight ones are read). The count is over (experts module, expert) pairs whose Fisher is present.
    """
    by_module: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    for name, target in targets.items():
        if not isinstance(target, ExpertWeight) or name not in fisher:
            continue
        module_name = name.rpartition(".")[0]
        f = fisher[name].reshape(target.experts, -1)  # (E, out*in) whatever its layout
        by_module.setdefault(module_name, []).append(f.abs().amax(dim=1) == 0)
        sizes[module_name] = target.experts
    found: dict[str, list[int]] = {}
    for module_name, zero_rows in by_module.items():
        unreached = torch.stack(zero_rows).all(dim=0)
        ids = [int(i) for i in torch.nonzero(unreached).flatten()]
        if ids:
            found[module_name] = ids
    return found, sum(sizes.values())


class UnroutedExpertsWarning(UserWarning):
    """compress quantized experts the calibration never routed a token to (zero Fisher: uniform weights)."""


def unrouted_message(found: Mapping[str, Sequence[int]], total: int) -> str:
    """The one-line warning for :func:`unrouted_experts`' result (``found`` not empty)."""
    count = sum(len(ids) for ids in found.values())
    where = "; ".join(f"{name} {list(ids)}" for name, ids in list(found.items())[:4])
    more = f"; and {len(found) - 4} more layers" if len(found) > 4 else ""
    return (
        f"{count} of {total} experts were never routed to by the calibration text (their Fisher is zero: "
        f"{where}{more}); they were quantized with uniform weights instead of their sensitivity. More "
        "calibration text or windows (--num-samples) reaches more experts"
    )


__all__ = [
    "ExpertWeight",
    "UnroutedExpertsWarning",
    "expert_count",
    "expert_modules",
    "expert_parameters",
    "is_experts_module",
    "per_expert_parameters",
    "stack_experts",
    "unrouted_experts",
    "unrouted_message",
    "unstack_experts",
]
