"""The plan stage of compress: each target linear's setting for the recipe's ``weights.target_bpw``.

For every linear and every candidate setting (squeeze.compression.bit_budget) the linear is quantized once
as the quantize stage would, giving its exact stored bits and its error estimate ``sum(F * (W - Q(W))**2)``
(F: the diagonal Fisher, the second-order change of the loss up to a constant factor; all ones without
calibration); fused linears add theirs up; the allocator then picks one setting per unit. The plan is
committed to the work area (``bit_plan.json``) before any layer group, so a resumed run quantizes the rest
of the model to the same plan; recomputed, it is the same plan (the estimate is deterministic).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from squeeze.compression.bit_budget import (
    Setting,
    allocate,
    candidate_settings,
    check_target,
    fused_units,
    planned_recipe,
    without_error_compensation,
)
from squeeze.compression.job import CompressJob, timed
from squeeze.compression.quantize import quantize_module, weight_format
from squeeze.config import Recipe
from squeeze.format.atomic import atomic_write_text
from squeeze.models.targets import matrix_fisher, target_matrix

PLAN_NAME = "bit_plan.json"
_PLAN_VERSION = 1
#: The plan stage estimates each setting's error on every ROW_STRIDE-th row of a matrix (see error_table).
ROW_STRIDE = 4
#: Fewest rows an estimate is made from.
MIN_SAMPLE_ROWS = 16


@dataclass(frozen=True)
class ErrorTable:
    """Per unit (linears sharing one setting, model order): stored bits and error of each candidate setting."""

    units: list[tuple[str, ...]]
    settings: tuple[Setting, ...]
    bits: list[list[int]]  # [unit][setting]
    errors: list[list[float]]  # [unit][setting]


def error_table(
    weights: Mapping[str, torch.Tensor],
    fisher: Mapping[str, torch.Tensor],
    recipe: Recipe,
    quantize: Callable[[torch.Tensor, torch.Tensor | None, Recipe], Any],
    *,
    row_stride: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> ErrorTable:
    """Bits and Fisher-weighted squared error of every candidate setting of every linear of ``weights``.

    weights: name -> fp32 (out, in), in model order; fisher: name -> fp32 (out, in), or empty (then every
    weight counts 1). quantize(weight, fisher or None, uniform recipe) -> a quantized weight (the quantize
    stage's ``quantize_module``), whose ``dequantize()`` gives the error. Bits are the format's exact size
    accounting (``estimate_bytes``, sparse values in the weight's dtype), what quantize stores.
    ``row_stride`` > 1 estimates the error from every ``row_stride``-th row only (at least 16 rows), scaled
    up to the whole matrix: every format here quantizes rows apart (a LUT, scales, a sparse share per row,
    the sparse share of the sample being the matrix's), so this is the same estimate on fewer rows,
    ``row_stride`` times cheaper.
    """
    settings = candidate_settings(recipe.weights)
    units = fused_units(list(weights))
    recipes = [planned_recipe(recipe, s) for s in settings]
    formats = [weight_format(r) for r in recipes]
    bits: list[list[int]] = []
    errors: list[list[float]] = []
    for done, unit in enumerate(units):
        unit_bits = [0] * len(settings)
        unit_errors = [0.0] * len(settings)
        for name in unit:
            w = weights[name]
            rows, cols = int(w.shape[0]), int(w.shape[1])
            f = fisher.get(name)
            sample = _sample_rows(rows, row_stride)
            ws, fs = (w, f) if sample is None else (w[sample], f[sample] if f is not None else None)
            scale = fs if fs is not None else torch.ones_like(ws)
            up = rows / ws.shape[0]
            for k, (uniform, fmt) in enumerate(zip(recipes, formats, strict=True)):
                q = quantize(ws, fs, uniform)
                unit_bits[k] += 8 * fmt.estimate_bytes(rows, cols, uniform.weights, w.element_size())
                unit_errors[k] += up * float((scale * (ws - q.dequantize()).square_()).sum(dtype=torch.float64))
        bits.append(unit_bits)
        errors.append(unit_errors)
        if progress:
            progress(done + 1, len(units))
    return ErrorTable(units=units, settings=settings, bits=bits, errors=errors)


def _sample_rows(rows: int, stride: int) -> torch.Tensor | None:
    """Every ``stride``-th row, evenly spread, at least MIN_SAMPLE_ROWS of them; None for all rows."""
    count = max(-(-rows // max(stride, 1)), MIN_SAMPLE_ROWS)
    if count >= rows:
        return None
    return torch.linspace(0, rows - 1, count).round().long().unique()


def plan_from_table(table: ErrorTable, target_bpw: float, n_weights: int) -> dict[str, Setting]:
    """Module name -> setting, the least summed error within ``target_bpw`` (ConfigError when out of reach)."""
    budget = check_target(target_bpw, n_weights, table.bits, "weights.target_bpw")
    choice = allocate(table.bits, table.errors, budget)
    return {name: table.settings[k] for unit, k in zip(table.units, choice, strict=True) for name in unit}


def plan_stage(job: CompressJob) -> None:
    """The plan of a budget recipe: read back from the work area, or estimated, allocated and committed."""
    target = job.recipe.weights.target_bpw
    if target is None:
        return
    # the linears and expert parameters (each one matrix, one setting): embeddings (weights.embedding_bits,
    # job.embeddings) keep the width the recipe gives them
    names = list(job.targets)
    settings = candidate_settings(job.recipe.weights)
    saved = load_plan(job.work.root, names, settings)
    if saved is not None:
        job.bit_plan = saved
        return
    progress = job.progress
    report = (lambda done, total: progress("plan", done, total)) if progress else None
    weights = {name: target_matrix(job.targets[name]) for name in names}  # (out, in); experts (E*out, in)
    fisher = {name: matrix_fisher(job.targets[name], f) for name, f in job.fisher.items() if name in job.targets}
    if job.recipe.weights.sensitivity != "fisher":
        fisher = {}
    timings: dict[str, float] = {}  # the candidates' k-means is the plan's time, not the quantize stage's

    def quantize(weight: torch.Tensor, f: torch.Tensor | None, uniform: Recipe) -> Any:
        return quantize_module(weight, f, _estimate_recipe(uniform), timings)

    table = error_table(weights, fisher, job.recipe, quantize, row_stride=ROW_STRIDE, progress=report)
    n_weights = sum(int(w.numel()) for w in weights.values())
    job.bit_plan = plan_from_table(table, target, n_weights)
    with timed(job.timings, "checkpoint"):
        save_plan(job.work.root, job.bit_plan, table)


def _estimate_recipe(recipe: Recipe) -> Recipe:
    """The recipe a setting's error is estimated with: error compensation off (it needs each layer's input
    Hessian and costs a GPTQ pass per candidate; the plain quantization ranks the layers' difficulty)."""
    return without_error_compensation(recipe)


def save_plan(root: Path, plan: Mapping[str, Setting], table: ErrorTable | None = None) -> None:
    """Commit the plan (and, for the record, the table it came from) as JSON in the work area ``root``."""
    record: dict[str, Any] = {
        "version": _PLAN_VERSION,
        "modules": {name: setting.to_dict() for name, setting in plan.items()},
    }
    if table is not None:
        record["table"] = {
            "settings": [s.label() for s in table.settings],
            "units": [list(u) for u in table.units],
            "bits": table.bits,
            "errors": table.errors,
        }
    atomic_write_text(root / PLAN_NAME, json.dumps(record, sort_keys=True) + "\n")


def load_plan(root: Path, names: Sequence[str], settings: Sequence[Setting]) -> dict[str, Setting] | None:
    """The committed plan when it covers exactly ``names`` with candidate ``settings``; else None (estimated
    again: the work area is this squeeze's own, but a plan it cannot use is recomputed, never guessed)."""
    path = root / PLAN_NAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        modules = record["modules"]
        if record["version"] != _PLAN_VERSION or sorted(modules) != sorted(names):
            return None
        plan = {name: Setting(**modules[name]) for name in names}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return plan if set(plan.values()) <= set(settings) else None


__all__ = ["PLAN_NAME", "ErrorTable", "error_table", "plan_from_table", "plan_stage", "save_plan", "load_plan"]
