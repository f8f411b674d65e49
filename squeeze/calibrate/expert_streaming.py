"""Which MoE blocks stream their routed experts in groups, and how: the group sizes and bounds, the resident rest
of the block, and the slicer that makes one group's experts resident (the walk itself:
squeeze.calibrate.expert_groups)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from squeeze.models.expert_params import is_experts_module, per_expert_parameters
from squeeze.models.families import expert_param_names

#: The fewest experts in a group: transformers' expert-parallel path counts one local expert's rows with
#: ``histc(min=0, max=0)``, which takes the data's own range and so counts the sentinel rows too.
MIN_GROUP = 2

#: ``slicer(experts module, start, stop)``: a context in which the module's per-expert parameters hold experts
#: ``start .. stop-1`` only (shape (stop-start, ...)), fp32, ``requires_grad=False``
Slicer = Callable[[nn.Module, int, int], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class ExpertStreaming:
    """Routed experts streamed ``size`` at a time inside a MoE block; ``slicer`` makes a group resident
    (default: views of the resident parameters)."""

    size: int
    slicer: Slicer | None = None

    def __post_init__(self) -> None:
        if self.size < MIN_GROUP:
            raise ValueError(f"an expert group holds at least {MIN_GROUP} experts, found {self.size}")


def grouped_experts(block: nn.Module, streaming: ExpertStreaming | None) -> nn.Module | None:
    """The block's experts module when it is streamed in groups (:func:`streamable_experts`, with more experts
    than one group); else None (the block runs whole)."""
    experts = streamable_experts(block) if streaming is not None else None
    if experts is None or streaming is None:
        return None
    return experts if len(groups_of(experts, streaming.size)) > 1 else None


def streamable_experts(block: nn.Module) -> nn.Module | None:
    """The block's experts module if its routed experts can be streamed in groups: exactly one experts module,
    run by transformers' ``grouped_mm`` implementation (the default), with at least 2 * MIN_GROUP experts."""
    found = [m for m in block.modules() if is_experts_module(m)]
    if len(found) != 1:
        return None
    experts = found[0]
    config = getattr(experts, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return None
    return experts if _num_experts(experts) >= 2 * MIN_GROUP else None


def resident_modules(block: nn.Module, experts: nn.Module) -> list[nn.Module]:
    """The block's modules that hold parameters of their own, the experts module excepted: what stays resident."""
    inside = {id(m) for m in experts.modules()}
    return [
        m for m in block.modules() if id(m) not in inside and next(iter(m.parameters(recurse=False)), None) is not None
    ]


def groups_of(experts: nn.Module, size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the experts module's experts cut into as few groups of at most ``size`` as fit,
    of nearly equal sizes (each at least MIN_GROUP)."""
    return group_bounds(_num_experts(experts), size)


def group_bounds(total: int, size: int) -> list[tuple[int, int]]:
    """:func:`groups_of` for ``total`` experts."""
    count = max(1, min(-(-total // max(size, MIN_GROUP)), total // MIN_GROUP))
    cuts = [total * j // count for j in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _num_experts(experts: nn.Module) -> int:
    return int(getattr(experts, "num_experts"))  # noqa: B009 - an int attribute, not a submodule


@contextlib.contextmanager
def view_slice(experts: nn.Module, start: int, stop: int) -> Iterator[None]:
    """The default :data:`Slicer`: each per-expert parameter replaced by a view of its rows ``start:stop``."""
    names = per_expert_parameters(experts)
    saved = {name: experts._parameters[name] for name in names}
    try:
        for name, param in saved.items():
            assert param is not None
            experts._parameters[name] = nn.Parameter(param.detach()[start:stop], requires_grad=False)
        yield
    finally:
        experts._parameters.update(saved)


def expert_targets(experts: nn.Module, targets: Mapping[str, Any]) -> dict[str, str]:
    """``{target name: parameter attribute}`` of the targets that are ``experts``' 3-D projections."""
    found: dict[str, str] = {}
    for name, target in targets.items():
        if getattr(target, "module", None) is experts and getattr(target, "attr", None) in expert_param_names():
            found[name] = target.attr
    return found


__all__ = [
    "MIN_GROUP",
    "ExpertStreaming",
    "Slicer",
    "expert_targets",
    "grouped_experts",
    "group_bounds",
    "groups_of",
    "resident_modules",
    "streamable_experts",
    "view_slice",
]
