"""The plan stage of compress: each target linear's setting for the recipe's ``weights.target_bpw``.

For every linear and every candidate setting (squeeze.compression.bit_budget) the linear is quantized once
as the quantize stage would, giving its exact stored bits and its error estimate ``sum(F * (W - Q(W))**2)``
(F: the diagonal Fisher, the second-order change of the loss up to a constant factor; all ones without
calibration); fused linears add theirs up; the allocator then picks one setting per unit. The plan is
committed to the work area (``bit_plan.json``) before any layer group, so a resumed run quantizes the rest
of the model to the same plan; recomputed, it is the same plan (the estimate is deterministic).

With ``weights.embedding_bits: auto`` the embeddings (``job.embeddings``) are units too, their candidates
EMBEDDING_SETTINGS (4, 6, 8 bits by squeeze.compression.embeddings, or KEPT: stored bits of the artifact's
unquantized dtype, error 0), their Fisher the one the sensitivity stage accumulates for them; the budget is
then over the linears' and the embeddings' weights together. An embedding the plan keeps leaves
``job.embeddings`` (and ``job.embedding_names``): the rest of the run treats it as a recipe with none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from squeeze.compression.bit_budget import (
    EMBEDDING_SETTINGS,
    Setting,
    allocate,
    candidate_settings,
    check_target,
    embedding_setting_bits,
    fused_units,
    planned_recipe,
    without_error_compensation,
)
from squeeze.compression.embeddings import embedding_recipe
from squeeze.compression.job import CompressJob, timed, weight_format
from squeeze.compression.quantize import quantize_module
from squeeze.config import EMBEDDING_AUTO, Recipe
from squeeze.format.atomic import atomic_write_text
from squeeze.models.targets import matrix_fisher, target_matrix
from squeeze.models.weight_dtype import keep_dtype

PLAN_NAME = "bit_plan.json"
_PLAN_VERSION = 1
#: The plan stage estimates each setting's error on every ROW_STRIDE-th row of a matrix (see error_table).
ROW_STRIDE = 4
#: Fewest rows an estimate is made from.
MIN_SAMPLE_ROWS = 16


@dataclass(frozen=True)
class ErrorTable:
    """Per unit (linears sharing one setting, model order; then the embeddings of ``embedding_bits: auto``, one
    unit each): stored bits and error of each candidate setting."""

    units: list[tuple[str, ...]]
    settings: tuple[Setting, ...]  # the linears' candidates
    bits: list[list[int]]  # [unit][setting]
    errors: list[list[float]]  # [unit][setting]
    #: the units that are embeddings (their names), whose candidates are EMBEDDING_SETTINGS
    embeddings: tuple[str, ...] = ()

    def candidates(self, unit: tuple[str, ...]) -> tuple[Setting, ...]:
        """The settings ``unit``'s bits and errors are given for."""
        return EMBEDDING_SETTINGS if unit[0] in self.embeddings else self.settings


def error_table(
    weights: Mapping[str, torch.Tensor],
    fisher: Mapping[str, torch.Tensor],
    recipe: Recipe,
    quantize: Callable[[torch.Tensor, torch.Tensor | None, Recipe], Any],
    *,
    row_stride: int = 1,
    progress: Callable[[int, int], None] | None = None,
    embeddings: Mapping[str, torch.Tensor] | None = None,
    kept_bytes: int = 4,
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

    embeddings (``embedding_bits: auto``): name -> fp32 (rows, dim) (Fisher in ``fisher`` alike), one unit
    each after the linears, at each of EMBEDDING_SETTINGS: quantized by their embedding recipe, or KEPT at
    ``kept_bytes`` per weight (the artifact's dtype for unquantized tensors) with error 0.
    """
    settings = candidate_settings(recipe.weights)
    embeddings = embeddings or {}
    units = fused_units(list(weights))
    recipes = [planned_recipe(recipe, s) for s in settings]
    bits: list[list[int]] = []
    errors: list[list[float]] = []
    total = len(units) + len(embeddings)
    for done, unit in enumerate(units):
        unit_bits, unit_errors = _unit_row(unit, weights, fisher, recipes, quantize, row_stride)
        bits.append(unit_bits)
        errors.append(unit_errors)
        if progress:
            progress(done + 1, total)
    for done, (name, w) in enumerate(embeddings.items(), start=len(units) + 1):
        unit_bits, unit_errors = _embedding_row(w, fisher.get(name), recipe, quantize, row_stride, kept_bytes)
        units.append((name,))
        bits.append(unit_bits)
        errors.append(unit_errors)
        if progress:
            progress(done, total)
    return ErrorTable(units=units, settings=settings, bits=bits, errors=errors, embeddings=tuple(embeddings))


def _unit_row(
    unit: tuple[str, ...],
    weights: Mapping[str, torch.Tensor],
    fisher: Mapping[str, torch.Tensor],
    recipes: list[Recipe],
    quantize: Callable[[torch.Tensor, torch.Tensor | None, Recipe], Any],
    row_stride: int,
) -> tuple[list[int], list[float]]:
    """One fused unit's bits and Fisher-weighted squared error at each uniform recipe (see :func:`error_table`)."""
    formats = [weight_format(r) for r in recipes]
    unit_bits = [0] * len(recipes)
    unit_errors = [0.0] * len(recipes)
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
    return unit_bits, unit_errors


def _embedding_row(
    w: torch.Tensor,
    f: torch.Tensor | None,
    recipe: Recipe,
    quantize: Callable[[torch.Tensor, torch.Tensor | None, Recipe], Any],
    row_stride: int,
    kept_bytes: int,
) -> tuple[list[int], list[float]]:
    """One embedding's bits and Fisher-weighted error at each of EMBEDDING_SETTINGS (rows sampled as the
    linears' are: every embedding format quantizes rows apart too)."""
    rows = int(w.shape[0])
    sample = _sample_rows(rows, row_stride)
    ws, fs = (w, f) if sample is None else (w[sample], f[sample] if f is not None else None)
    scale = fs if fs is not None else torch.ones_like(ws)
    up = rows / ws.shape[0]
    bits: list[int] = []
    errors: list[float] = []
    for setting in EMBEDDING_SETTINGS:
        bits.append(embedding_setting_bits(w.shape, recipe.weights, setting, w.element_size(), kept_bytes))
        if setting.kept:
            errors.append(0.0)
            continue
        q = quantize(ws, fs, embedding_recipe(recipe, setting.bits))
        errors.append(up * float((scale * (ws - q.dequantize()).square_()).sum(dtype=torch.float64)))
    return bits, errors


def _sample_rows(rows: int, stride: int) -> torch.Tensor | None:
    """Every ``stride``-th row, evenly spread, at least MIN_SAMPLE_ROWS of them; None for all rows."""
    count = max(-(-rows // max(stride, 1)), MIN_SAMPLE_ROWS)
    if count >= rows:
        return None
    return torch.linspace(0, rows - 1, count).round().long().unique()


def plan_from_table(table: ErrorTable, target_bpw: float, n_weights: int) -> dict[str, Setting]:
    """Module name -> setting, the least summed error within ``target_bpw`` over ``n_weights`` (the
    embeddings' weights included when the table has them) (ConfigError when out of reach)."""
    where = "weights.target_bpw"
    budget = check_target(target_bpw, n_weights, table.bits, where, embeddings=bool(table.embeddings))
    choice = allocate(table.bits, table.errors, budget)
    return {name: table.candidates(unit)[k] for unit, k in zip(table.units, choice, strict=True) for name in unit}


def plan_stage(job: CompressJob) -> None:
    """The plan of a budget recipe: read back from the work area, or estimated, allocated and committed."""
    target = job.recipe.weights.target_bpw
    if target is None:
        return
    # the linears and expert parameters (each one matrix, one setting); the embeddings (job.embeddings) too with
    # embedding_bits auto, else they keep the width the recipe gives them
    names = list(job.targets)
    auto = job.recipe.weights.embedding_bits == EMBEDDING_AUTO
    embedding_names = list(job.embeddings) if auto else []
    settings = candidate_settings(job.recipe.weights)
    saved = load_plan(job.work.root, names, settings, embedding_names)
    if saved is not None:
        job.bit_plan = saved
        _drop_kept_embeddings(job)
        return
    progress = job.progress
    report = (lambda done, total: progress("plan", done, total)) if progress else None
    weights = {name: target_matrix(job.targets[name]) for name in names}  # (out, in); experts (E*out, in)
    fisher = {name: matrix_fisher(job.targets[name], f) for name, f in job.fisher.items() if name in job.targets}
    if job.recipe.weights.sensitivity == "uniform":
        fisher = {}
    timings: dict[str, float] = {}  # the candidates' k-means is the plan's time, not the quantize stage's

    def quantize(weight: torch.Tensor, f: torch.Tensor | None, uniform: Recipe) -> Any:
        return quantize_module(weight, f, _estimate_recipe(uniform), timings)

    embeddings = {name: job.embeddings[name].weight.detach().float() for name in embedding_names}
    if job.recipe.weights.sensitivity != "uniform":  # (rows, dim), as the weight: the sensitivity stage's own
        fisher.update({name: job.fisher[name] for name in embedding_names if name in job.fisher})
    kept_bytes = keep_dtype(job.source, job.recipe.output.keep_dtype).itemsize
    table = error_table(
        weights,
        fisher,
        job.recipe,
        quantize,
        row_stride=ROW_STRIDE,
        progress=report,
        embeddings=embeddings,
        kept_bytes=kept_bytes,
    )
    n_weights = sum(int(w.numel()) for w in [*weights.values(), *embeddings.values()])
    job.bit_plan = plan_from_table(table, target, n_weights)
    with timed(job.timings, "checkpoint"):
        save_plan(job.work.root, job.bit_plan, table)
    _drop_kept_embeddings(job)


def _drop_kept_embeddings(job: CompressJob) -> None:
    """The embeddings the plan keeps leave ``job.embeddings`` / ``job.embedding_names`` (and the plan): the
    quantize and write stages then store them unquantized, as for ``embedding_bits: null``."""
    kept = {name for name, setting in job.bit_plan.items() if setting.kept}
    if not kept:
        return
    job.embeddings = {name: m for name, m in job.embeddings.items() if name not in kept}
    job.embedding_names = tuple(name for name in job.embedding_names if name not in kept)
    job.bit_plan = {name: setting for name, setting in job.bit_plan.items() if name not in kept}


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
            "embedding_settings": [s.label() for s in EMBEDDING_SETTINGS] if table.embeddings else [],
            "embeddings": list(table.embeddings),
            "units": [list(u) for u in table.units],
            "bits": table.bits,
            "errors": table.errors,
        }
    atomic_write_text(root / PLAN_NAME, json.dumps(record, sort_keys=True) + "\n")


def load_plan(
    root: Path, names: Sequence[str], settings: Sequence[Setting], embeddings: Sequence[str] = ()
) -> dict[str, Setting] | None:
    """The committed plan when it covers exactly ``names`` with candidate ``settings`` and ``embeddings``
    (``embedding_bits: auto``) with EMBEDDING_SETTINGS; else None (estimated again: the work area is this
    squeeze's own, but a plan it cannot use is recomputed, never guessed)."""
    path = root / PLAN_NAME
    every = [*names, *embeddings]
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        modules = record["modules"]
        if record["version"] != _PLAN_VERSION or sorted(modules) != sorted(every):
            return None
        plan = {name: Setting(**modules[name]) for name in every}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    linears_fit = {plan[name] for name in names} <= set(settings)
    return plan if linears_fit and {plan[name] for name in embeddings} <= set(EMBEDDING_SETTINGS) else None


__all__ = ["PLAN_NAME", "ErrorTable", "error_table", "plan_from_table", "plan_stage", "save_plan", "load_plan"]
