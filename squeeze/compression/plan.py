"""``squeeze compress --plan``: what a run will need, per rank, from the model's config.json alone (no weights).

The model is built on the meta device (preflight.meta_model), which gives every tensor's shape, the targets the
recipe quantizes, the exact artifact size and the layer groups. From those, per rank of a torchrun world:

* host memory at the peak: the preflight estimates the run itself checks (unbounded:
  preflight.estimate_peak_memory; ``--max-memory``: bounded_preflight.streaming_peak_bytes), and with ``--device`` the
  GPU's: one block's fp32 weights, their float64 Fisher sums and one gradient, one window's activations, or the
  LM head with one window's logits, or one target's k-means scratch, whichever is largest;
* the work area's disk at the peak (the Fisher checkpoint, the group checkpoints, the spilled activations of a
  bounded run, the staged artifact);
* seconds per stage, from per-unit rates measured on a named machine (plan_rates.json, data: the machine, the
  command and the date come with the numbers). Work that ranks share is divided as the run divides it: windows
  split evenly, layer groups dealt round robin, writing and sealing on rank 0. A device with no measured rates
  gets no time (None), never a guess.

A config squeeze cannot compress raises the error the run would raise (ModelError / ConfigError naming what is
missing); what the plan finds over budget (a ``--max-memory`` below the minimum, a block larger than one GPU)
is listed in ``notes``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import model_parts
from squeeze.calibrate.expert_streaming import group_bounds
from squeeze.calibrate.hessian import hessian_bytes_bound
from squeeze.compression import bounded_preflight, expert_plan
from squeeze.compression.plan_rates import PlanWork, RankPlan, Rates, load_rates, machine_note, rank_plan
from squeeze.compression.preflight import (
    BASE_PROCESS_BYTES,
    SizeEstimate,
    check_context_length,
    check_device_options,
    estimate_peak_memory,
    estimate_size,
    meta_model,
    parse_device,
)
from squeeze.compression.quantize import layer_groups
from squeeze.config import Recipe
from squeeze.errors import ConfigError
from squeeze.models.config_bounds import defaulted_size_keys, describe_defaults
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.source import ModelSource, resolve_model
from squeeze.models.targets import find_targets, linear_targets

#: Ranks a plan is made for at most (a line each): past any data-parallel compress world squeeze would start.
MAX_PLAN_RANKS = 4096

DEVICE_BASE_BYTES = expert_plan.DEVICE_BASE_BYTES


@dataclass(frozen=True)
class CompressPlan:
    """A compress run's needs, from the config alone: sizes, the work area's disk, and every rank's plan."""

    model: str
    recipe: str
    parameters: int
    active_parameters: int  # per token: a MoE model's routed experts counted at top-k of E
    quantized_weights: int
    artifact_bytes: int
    work_disk_bytes: int
    num_samples: int | None
    seq_len: int | None
    max_memory: int | None
    device: str | None
    rates: Rates | None
    ranks: tuple[RankPlan, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: ``--max-memory``: routed experts of a MoE block resident at once (None: every block whole), of ``experts``
    #: per block (0: a dense model), and the smallest admissible budget (one group plus the resident part)
    expert_group: int | None = None
    experts: int = 0
    minimum_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranks"] = [{**asdict(r), "total_seconds": r.total_seconds} for r in self.ranks]
        return data


@dataclass(frozen=True)
class _Planned:
    """The model a plan is made for, checked as the run would check it: its source, meta skeleton, recipe,
    targets and exact artifact size."""

    source: ModelSource
    skeleton: nn.Module
    recipe: Recipe
    targets: dict[str, Any]
    size: SizeEstimate


def plan_compress(
    model: str | ModelSource,
    recipe: Recipe,
    *,
    num_samples: int | None,
    seq_len: int | None,
    max_memory: int | None = None,
    device: str | None = None,
    ranks: int = 1,
) -> CompressPlan:
    """The plan of ``squeeze compress model`` with ``recipe`` (``num_samples`` x ``seq_len`` calibration tokens,
    None: a recipe without Fisher), ``max_memory`` bytes, ``device`` ("cuda", "cuda:N", "cpu"; its spelling is
    checked, not its presence: a plan is often made away from the GPUs) and ``ranks`` torchrun processes."""
    if ranks < 1 or ranks > MAX_PLAN_RANKS:  # one line per rank: a million ranks printed 699,387 lines
        raise ConfigError(
            f"--ranks must be from 1 to {MAX_PLAN_RANKS}, found {ranks}",
            hint=f"pass --ranks 1 to {MAX_PLAN_RANKS} (the torchrun processes the run will start)",
        )
    compute = parse_device(device)
    planned = _checked_model(model, recipe, seq_len, max_memory, compute)
    source, skeleton, targets, size = planned.source, planned.skeleton, planned.targets, planned.size
    params = _numel(skeleton)
    active = _active_parameters(skeleton, targets)
    host, gpu, groups_plan = _peaks(planned, seq_len, num_samples, max_memory, compute)
    expert_group = groups_plan.group if groups_plan is not None else None
    # with ranks, expert groups are dealt one by one (each rank's count is then of those units)
    sizes = _work_units(layer_groups(skeleton, targets), targets, expert_group if ranks > 1 else None)
    rates = load_rates(compute.type if compute is not None else "cpu")
    work = PlanWork(
        host=host,
        gpu=gpu,
        group_sizes=tuple(sizes),
        num_samples=num_samples,
        seq_len=seq_len,
        active=active,
        source_bytes=_source_bytes(source, params),
        artifact_bytes=size.total_bytes,
        streamed=max_memory is not None,
    )
    return CompressPlan(
        model=source.model_id,
        recipe=recipe.name,
        parameters=params,
        active_parameters=active,
        quantized_weights=size.n_quantized_weights,
        artifact_bytes=size.total_bytes,
        work_disk_bytes=_work_disk(planned, num_samples, seq_len, max_memory),
        num_samples=num_samples,
        seq_len=seq_len,
        max_memory=max_memory,
        device=str(compute) if compute is not None else None,
        rates=rates,
        ranks=tuple(rank_plan(rank, ranks, work, rates) for rank in range(ranks)),
        notes=tuple(_notes(planned, groups_plan, max_memory, gpu, ranks, rates)),
        expert_group=expert_group,
        experts=groups_plan.experts if groups_plan is not None else 0,
        minimum_bytes=groups_plan.minimum_bytes if groups_plan is not None and max_memory is not None else None,
    )


def _checked_model(
    model: str | ModelSource,
    recipe: Recipe,
    seq_len: int | None,
    max_memory: int | None,
    compute: torch.device | None,
) -> _Planned:
    """The model on the meta device, refused as the run would refuse it (device options, context length, a
    bounded run's streamability, a block walk on the GPU)."""
    check_device_options(compute, error_compensation=_uses_hessians(recipe), ranks=1)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    skeleton = meta_model(source)  # ModelError naming what transformers could not build
    weights = recipe.weights
    targets = find_targets(skeleton, weights.targets, weights.ignore)  # ModelError when nothing is quantizable
    if seq_len is not None:
        check_context_length(skeleton, seq_len)
    if max_memory is not None:
        bounded_preflight.check_streamable(source, recipe, skeleton, targets)
    elif compute is not None and seq_len is not None:
        model_parts(skeleton, option="--device")
    return _Planned(source, skeleton, recipe, targets, estimate_size(skeleton, recipe, targets=targets))


def _peaks(
    planned: _Planned,
    seq_len: int | None,
    num_samples: int | None,
    max_memory: int | None,
    compute: torch.device | None,
) -> tuple[int, int | None, expert_plan.ExpertPlan | None]:
    """Host and GPU bytes at the peak (GPU: None without one), and the expert groups the run would pick."""
    skeleton, recipe, targets, total = planned.skeleton, planned.recipe, planned.targets, planned.size.total_bytes
    cuda = compute is not None and compute.type == "cuda"
    if max_memory is not None:  # a MoE block's routed experts in groups sized to the budget (and an 80 GB GPU)
        device_bytes = expert_plan.DEFAULT_DEVICE_BYTES if cuda else None
        groups_plan = expert_plan.plan_expert_groups(
            skeleton, recipe, targets, seq_len, total, max_memory, device_bytes
        )
        return groups_plan.peak_bytes, groups_plan.device_peak_bytes, groups_plan
    host = _host_peak(skeleton, recipe, targets, seq_len, num_samples, total, compute)
    if not cuda:
        return host, None, None
    # the experts in groups that fit an 80 GB GPU, as the run picks them for its device
    groups_plan = expert_plan.plan_expert_groups(
        skeleton, recipe, targets, seq_len, total, None, expert_plan.DEFAULT_DEVICE_BYTES
    )
    return host, groups_plan.device_peak_bytes, groups_plan


def _notes(
    planned: _Planned,
    groups: expert_plan.ExpertPlan | None,
    max_memory: int | None,
    gpu: int | None,
    ranks: int,
    rates: Rates | None,
) -> list[str]:
    """What the plan assumed (sizes config.json leaves out), finds over budget, the expert groups it chose,
    and whose machine its times are."""
    notes: list[str] = []
    defaults = defaulted_size_keys(planned.source, planned.skeleton.config)
    if defaults:  # transformers fills a size config.json leaves out (32 layers for Llama): say what was planned
        notes.append(f"config.json does not name {describe_defaults(defaults)}: planned with transformers' defaults")
    if groups is not None and max_memory is not None and max_memory < groups.minimum_bytes:
        notes.append(
            f"--max-memory {max_memory / 1e9:.2f} GB is below this run's minimum of {groups.minimum_bytes / 1e9:.2f} GB"
        )
    if groups is not None and groups.group is not None:
        fit = (
            f"the smallest admissible --max-memory is {groups.minimum_bytes / 1e9:.2f} GB"
            if max_memory is not None
            else "to fit an 80 GB GPU"
        )
        notes.append(
            f"routed experts streamed {groups.group} at a time inside each MoE block (of {groups.experts}); {fit}"
        )
        if ranks > 1:
            notes.append(
                "quantize work dealt to ranks by (block, expert group) in this plan; the run deals whole layer groups"
            )
    if gpu is not None and gpu > expert_plan.DEFAULT_DEVICE_BYTES:
        notes.append(f"one step needs {gpu / 1e9:.0f} GB on the GPU: more than an 80 GB H100 holds")
    if (note := machine_note(rates)) is not None:
        notes.append(note)
    return notes


def _work_units(groups: list[list[str]], targets: dict[str, Any], expert_group: int | None) -> list[int]:
    """Quantized weights per unit of work dealt to ranks: a layer group; with experts streamed in groups, a
    block's own targets and each of its expert groups (dealt to ranks one by one)."""
    units: list[int] = []
    for names in groups:
        found = [targets[name] for name in names if name in targets]
        routed = [t for t in found if isinstance(t, ExpertWeight)] if expert_group is not None else []
        own = sum(t.weight.numel() for t in found if not any(t is r for r in routed))
        if not routed:
            units.append(own)
            continue
        if own:
            units.append(own)
        count = routed[0].experts
        for start, stop in group_bounds(count, expert_group or count):
            units.append(sum(t.weight.numel() * (stop - start) // count for t in routed))
    return units


def _uses_hessians(recipe: Recipe) -> bool:
    from squeeze.compression.quantize import weight_format

    return bool(weight_format(recipe).uses_hessian and recipe.weights.error_compensation)


def _numel(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in module.parameters():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel()
    return total


def _active_parameters(skeleton: nn.Module, targets: dict[str, Any]) -> int:
    """Parameters a token runs through: all of them, but a routed expert parameter only at top-k of E."""
    config = getattr(skeleton, "config", None)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    inactive = 0
    for target in targets.values():
        if isinstance(target, ExpertWeight) and top_k and target.experts > top_k:
            inactive += target.weight.numel() * (target.experts - top_k) // target.experts
    return _numel(skeleton) - inactive


def _host_peak(
    skeleton: nn.Module,
    recipe: Recipe,
    targets: dict[str, Any],
    seq_len: int | None,
    num_samples: int | None,
    artifact_bytes: int,
    device: torch.device | None,
) -> int:
    """Host bytes at the peak of an unbounded run: preflight's estimate; with a GPU the fp32 model, the fp32
    Fisher coming back block by block and every block boundary's hidden states (in memory)."""
    if device is None or device.type == "cpu" or seq_len is None:
        return estimate_peak_memory(skeleton, recipe, seq_len, targets=targets)
    params = _numel(skeleton) * 4
    fisher = sum(t.weight.numel() for t in targets.values()) * 4
    boundaries = bounded_preflight.spill_bytes(skeleton, num_samples or 1, seq_len)
    return BASE_PROCESS_BYTES + params + max(params, fisher + boundaries)


def _work_disk(planned: _Planned, num_samples: int | None, seq_len: int | None, max_memory: int | None) -> int:
    """The work area at its peak: the staged artifact, the group checkpoints, the fp32 Fisher checkpoint, the
    input Hessians (error compensation) and a bounded run's spilled block boundaries."""
    total = planned.size.total_bytes + planned.size.quantized_bytes
    if seq_len is not None:
        total += sum(t.weight.numel() for t in planned.targets.values()) * 4
        if _uses_hessians(planned.recipe):
            total += hessian_bytes_bound(linear_targets(planned.targets))
        if max_memory is not None:
            total += bounded_preflight.spill_bytes(planned.skeleton, num_samples or 1, seq_len)
    return total


def _source_bytes(source: ModelSource, params: int) -> int:
    """Bytes of the source's weight files; for a config without weights (a plan made away from the checkpoint),
    the ``params`` the config describes at the size of its ``torch_dtype`` (bfloat16 when it names none)."""
    files = list(source.directory.glob("*.safetensors")) if source.gguf_file is None else [source.path]
    found = sum(f.stat().st_size for f in files if f.is_file())
    if found:
        return found
    config = json.loads((source.directory / "config.json").read_text())
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), None)
    return params * (dtype.itemsize if isinstance(dtype, torch.dtype) else 2)


__all__ = ["CompressPlan", "RankPlan", "Rates", "load_rates", "plan_compress"]
