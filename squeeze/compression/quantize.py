"""The quantize stage: every target linear quantized, one decoder block (layer group) at a time.

Each group is committed to the work area as soon as it is done, so an interrupted job resumes after the
last committed group; a committed group is never recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.expert_streaming import ExpertStreaming, group_bounds, view_slice
from squeeze.compression.bit_budget import planned_recipe, without_error_compensation
from squeeze.compression.distributed import owns_group
from squeeze.compression.embeddings import embedding_recipe
from squeeze.compression.expert_plan import rows_independent
from squeeze.compression.job import CompressJob, timed, weight_format
from squeeze.config import Recipe
from squeeze.models.expert_params import ExpertWeight, expert_modules, stack_experts, unrouted_experts
from squeeze.models.placement import to_device
from squeeze.models.targets import matrix_fisher
from squeeze.quant.schemes import WeightFormat


def quantize_module(
    weight: torch.Tensor,
    fisher: torch.Tensor | None,
    recipe: Recipe,
    timings: dict[str, float] | None = None,
    hessian: torch.Tensor | None = None,
    held_out: torch.Tensor | None = None,
    report: dict[str, float] | None = None,
) -> WeightFormat:
    """Quantize one (out, in) fp32 weight by the format ``recipe.weights`` selects.

    The format's named parts (e.g. "sparse" / "kmeans", "rtn", "ec") add their seconds to ``timings``.
    ``hessian``: fp32 (in, in) input Hessian, passed to formats that use one when the recipe's
    ``weights.error_compensation`` is on; ``held_out``: the held-out windows' one (``weights.lnq_rounds``),
    whose per-layer objectives before / after go into ``report``.
    """
    timings = {} if timings is None else timings
    fisher = fisher if recipe.weights.sensitivity != "uniform" else None
    fmt = weight_format(recipe)
    timer = lambda part: timed(timings, part)  # noqa: E731
    if fmt.uses_hessian and recipe.weights.error_compensation:
        if recipe.weights.lnq_rounds:
            return fmt.quantize(  # type: ignore[call-arg]
                weight, fisher, recipe.weights, timer, hessian=hessian, held_out=held_out, lnq_report=report
            )
        return fmt.quantize(weight, fisher, recipe.weights, timer, hessian=hessian)  # type: ignore[call-arg]
    return fmt.quantize(weight, fisher, recipe.weights, timer)


def _quantize_on(
    job: CompressJob,
    weight: torch.Tensor,
    fisher: torch.Tensor | None,
    recipe: Recipe,
    hessian: torch.Tensor | None = None,
    held_out: torch.Tensor | None = None,
    report: dict[str, float] | None = None,
) -> WeightFormat:
    """quantize_module on the job's device (--device: k-means / sparse selection there)."""
    if job.device is not None:
        weight, fisher = to_device((weight, fisher), job.device)
    return quantize_module(weight, fisher, recipe, job.timings, hessian, held_out, report)


def _expert_groups(
    job: CompressJob, module: ExpertWeight, fisher: torch.Tensor | None, recipe: Recipe, experts: ExpertStreaming
) -> WeightFormat:
    """An expert parameter quantized a group of experts' rows at a time (each group's rows read by
    ``experts.slicer``, its Fisher rows sliced), the parts stacked by rows: every row quantized on its own, as in
    the whole (E*out, in) matrix."""
    slicer = experts.slicer or view_slice
    parts = []
    for start, stop in group_bounds(module.experts, experts.size):
        with slicer(module.module, start, stop):
            weight = stack_experts(module.weight.detach().float(), module.transposed)
            rows = None if fisher is None else stack_experts(fisher[start:stop], module.transposed)
            part = _quantize_on(job, weight, rows, recipe)
        parts.append(part)
    return type(parts[0]).cat_rows(parts)


def layer_groups(net: nn.Module, targets: Mapping[str, object]) -> list[list[str]]:
    """Target names grouped by decoder block (``...layers.<i>``), in model order: the checkpoint unit.

    A name is a linear's (or embedding's) module name, its weight ``{name}.weight``, or an expert parameter's
    path (its state-dict key itself)."""
    order = [key.removesuffix(".weight") for key in net.state_dict() if key.removesuffix(".weight") in targets]
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(order):
        match = _BLOCK_RE.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return list(groups.values())


_BLOCK_RE = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.")


def quantize_stage(job: CompressJob) -> None:
    """Quantize every group without a committed checkpoint, committing each as soon as it is done."""
    job.groups = layer_groups(job.loaded_model(), {**job.targets, **job.embeddings})
    done = 0
    for index, names in enumerate(job.groups):
        if not owns_group(index, job.world):  # under torchrun another rank quantizes it (distributed.py)
            continue
        with timed(job.timings, "checkpoint"):
            committed = job.work.has_group(index, names)
        if committed:
            for name in names:
                job.fisher.pop(name, None)
                job.hessians.pop(name, None)
                job.held_out_hessians.pop(name, None)
        else:
            # --device cuda with a MoE block too large for the device: its experts' rows a group at a time (views)
            streaming = ExpertStreaming(job.expert_group) if job.expert_group is not None else None
            tensors, meta = quantize_group(job, names, *((streaming,) if streaming is not None else ()))
            with timed(job.timings, "checkpoint"):
                job.work.save_group(index, tensors, meta)
        done += len(names)
        if job.progress:
            job.progress("quantize", done, len(job.targets))
    job.fisher = {}  # every entry was used once; free the memory before the write stage
    job.hessians = {}
    job.held_out_hessians = {}


def quantize_group(
    job: CompressJob, names: list[str], streaming: ExpertStreaming | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One group's tensors ({tensor name: tensor}) and checkpoint metadata (modules, tensor names, bits; for
    experts modules their expert count and the experts calibration never reached). ``streaming``: an expert
    parameter's rows quantized a group of experts at a time (read by its slicer) when the format quantizes rows
    independently (squeeze.compression.expert_plan.rows_independent): the same bits, one group resident."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"modules": names, "tensors": {}, "storage_bits": {}, "specs": {}}
    experts = {name: t for name in names if isinstance(t := job.targets.get(name), ExpertWeight)}
    expert_fisher: dict[str, torch.Tensor] = {}
    for name in names:
        module = job.targets[name] if name in job.targets else job.embeddings[name]
        hessian = job.hessians.pop(name, None)
        held_out = job.held_out_hessians.pop(name, None)
        # an embedding by weights.embedding_bits (auto: the width the budget planned for it); a linear (or expert
        # parameter) by a budget's setting for it
        setting = job.bit_plan.get(name)
        if name in job.embeddings:
            recipe = embedding_recipe(job.recipe, setting.bits if setting is not None else None)
        else:
            recipe = planned_recipe(job.recipe, setting)
        fisher = job.fisher.pop(name, None)
        spec_extra: dict[str, Any] = {}
        if isinstance(module, ExpertWeight) and streaming is not None and rows_independent(recipe):
            if fisher is not None:
                expert_fisher[name] = fisher
            qweight = _expert_groups(job, module, fisher, without_error_compensation(recipe), streaming)
            spec_extra = {"experts": module.experts, "transposed": module.transposed}
        else:
            if isinstance(module, ExpertWeight):
                # one (E*out, in) matrix, its Fisher stacked alike; no input Hessian: quantized without compensation
                weight, recipe = module.matrix(), without_error_compensation(recipe)
                if fisher is not None:
                    expert_fisher[name] = fisher
                    fisher = matrix_fisher(module, fisher)
                spec_extra = {"experts": module.experts, "transposed": module.transposed}
            else:
                weight = module.weight.detach().float()
            report: dict[str, float] = {}
            qweight = _quantize_on(job, weight, fisher, recipe, hessian, held_out, report)
            if report:  # weights.lnq_rounds: the layer's objectives, into the compress result (lnq_layers)
                meta.setdefault("lnq", {})[name] = report
        parts = qweight.to_tensors(name)
        if job.device is not None:
            parts = {key: tensor.cpu() for key, tensor in parts.items()}
        tensors.update(parts)
        meta["tensors"][name] = list(parts)
        meta["storage_bits"][name] = qweight.storage_bits()
        # the artifact's module entry: the weight actually written (an expert parameter: E and its layout too)
        meta["specs"][name] = {**qweight.module_spec(), **spec_extra}
    if experts:
        meta["experts"] = {module: t.experts for module, t in expert_modules(experts).items()}
        # zero Fisher (no calibration token routed there): the LUT k-means fits such rows with uniform weights
        # (squeeze.quant.kmeans), as --sensitivity uniform would; the write stage counts and warns (assemble.py)
        meta["unrouted"] = unrouted_experts(expert_fisher, experts)[0]
    return tensors, meta


__all__ = ["layer_groups", "quantize_group", "quantize_module", "quantize_stage"]
