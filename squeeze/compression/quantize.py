"""The quantize stage: every target linear quantized, one decoder block (layer group) at a time.

Each group is committed to the work area as soon as it is done, so an interrupted job resumes after the
last committed group; a committed group is never recomputed.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from squeeze.compression.job import CompressJob, timed
from squeeze.config import Recipe
from squeeze.quant.nuq import quantize_lut
from squeeze.quant.qweight import QuantizedWeight
from squeeze.quant.rtn import rtn_quantize
from squeeze.quant.sparse import select_sparse


def quantize_module(
    weight: torch.Tensor, fisher: torch.Tensor | None, recipe: Recipe, timings: dict[str, float] | None = None
) -> QuantizedWeight:
    """Quantize one (out, in) fp32 weight as ``recipe.weights`` says.

    Adds "sparse" / "kmeans" / "rtn" seconds to ``timings``.
    """
    w = recipe.weights
    timings = {} if timings is None else timings
    if w.method == "rtn":
        with timed(timings, "rtn"):
            return rtn_quantize(weight, w.bits, w.group_size)
    fisher = fisher if w.sensitivity == "fisher" else None
    mask = None
    if w.sensitive_fraction or w.outlier_fraction:
        with timed(timings, "sparse"):
            mask = select_sparse(weight, fisher, w.sensitive_fraction, w.outlier_fraction)
    with timed(timings, "kmeans"):
        return quantize_lut(weight, fisher, w.bits, w.sensitive_fraction, w.outlier_fraction, mask=mask,
                            lut_dtype=w.lut_dtype)


def layer_groups(net: nn.Module, targets: dict[str, nn.Linear]) -> list[list[str]]:
    """Target linears grouped by decoder block (``...layers.<i>``), in model order: the checkpoint unit."""
    order = [key.removesuffix(".weight") for key in net.state_dict() if key.removesuffix(".weight") in targets]
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(order):
        match = _BLOCK_RE.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return list(groups.values())


_BLOCK_RE = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.")


def quantize_stage(job: CompressJob) -> None:
    """Quantize every group without a committed checkpoint, committing each as soon as it is done."""
    job.groups = layer_groups(job.loaded_model(), job.targets)
    done = 0
    for index, names in enumerate(job.groups):
        with timed(job.timings, "checkpoint"):
            committed = job.work.has_group(index, names)
        if committed:
            for name in names:
                job.fisher.pop(name, None)
        else:
            tensors, meta = _quantize_group(job, names)
            with timed(job.timings, "checkpoint"):
                job.work.save_group(index, tensors, meta)
        done += len(names)
        if job.progress:
            job.progress("quantize", done, len(job.targets))
    job.fisher = {}  # every entry was used once; free the memory before the write stage


def _quantize_group(job: CompressJob, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One group's tensors ({tensor name: tensor}) and checkpoint metadata (modules, tensor names, bits)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"modules": names, "tensors": {}, "storage_bits": {}}
    for name in names:
        weight = job.targets[name].weight.detach().float()
        qweight = quantize_module(weight, job.fisher.pop(name, None), job.recipe, job.timings)
        parts = qweight.to_tensors(name)
        tensors.update(parts)
        meta["tensors"][name] = list(parts)
        meta["storage_bits"][name] = qweight.storage_bits()
    return tensors, meta


__all__ = ["quantize_module", "layer_groups", "quantize_stage"]
