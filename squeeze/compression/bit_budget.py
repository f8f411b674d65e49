"""Bits per layer for an average budget (``weights.target_bpw``): the settings, the units, the allocator.

A *setting* is what one quantized linear can be given: a code width (2, 3, 4 or 8 bits) and, when the
recipe has a sparse part, either that part or none (dense only). A *unit* is a set of linears that must
share one setting: the projections a runtime fuses into one GEMM (q/k/v, gate/up) of one block, else a
single linear. Given per unit and setting its stored bits (exact, LUTs / scales / sparse entries included)
and its estimated error (the Fisher-weighted squared error of its quantization), :func:`allocate` picks one
setting per unit minimising the summed error with the summed bits within the budget: a multiple-choice
knapsack, solved exactly by dynamic programming over the budget cut into at most ``resolution`` steps
(exact when the bits are already that coarse), then topped up greedily with the exact leftover bits.

With ``weights.embedding_bits: auto`` each embedding (the input embedding; an untied LM head apart; a tied
pair once) is one more unit, its candidates EMBEDDING_SETTINGS: 4, 6 or 8 bits (the formats of
squeeze.compression.embeddings) or KEPT (unquantized, in the artifact's dtype for unquantized tensors). Its
weights then count in the average: ``target_bpw`` is over every parameter the plan may quantize.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from squeeze.compression.embeddings import embedding_recipe
from squeeze.config import EMBEDDING_AUTO, EMBEDDING_BITS, ERROR_COMPENSATION_OPTIONS, Recipe, WeightsConfig
from squeeze.errors import ConfigError
from squeeze.limits import WEIGHT_BITS
from squeeze.models.families import fused_groups
from squeeze.quant.schemes import format_for_recipe

#: Budget steps of the dynamic program: the plan may leave up to (units / resolution) of the budget unused
#: before the greedy top-up (120 units of SmolLM2: 0.2%); time and memory grow linearly with it.
DEFAULT_RESOLUTION = 1 << 16


@dataclass(frozen=True, order=True)
class Setting:
    """One choice for a linear: code width and sparse fractions (of all its weights)."""

    bits: int
    sensitive_fraction: float = 0.0
    outlier_fraction: float = 0.0

    @property
    def sparse(self) -> bool:
        return bool(self.sensitive_fraction or self.outlier_fraction)

    @property
    def kept(self) -> bool:
        """An embedding left unquantized (KEPT)."""
        return self.bits == 0

    def label(self) -> str:
        """``w3``, ``w3-s045``-style (the sparse percentage in hundredths of a percent when it is not 0.45%);
        ``kept`` for KEPT."""
        if self.kept:
            return "kept"
        if not self.sparse:
            return f"w{self.bits}"
        return f"w{self.bits}-s{round((self.sensitive_fraction + self.outlier_fraction) * 1e4):03d}"

    def weights(self, base: WeightsConfig) -> WeightsConfig:
        """``base`` with this setting's width and fractions, and no budget (a uniform config; an ``auto``
        embedding width, which needs a budget, is the plan's business and dropped)."""
        return replace(
            base,
            bits=self.bits,
            sensitive_fraction=self.sensitive_fraction,
            outlier_fraction=self.outlier_fraction,
            target_bpw=None,
            embedding_bits=None if base.embedding_bits == EMBEDDING_AUTO else base.embedding_bits,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "sensitive_fraction": self.sensitive_fraction,
            "outlier_fraction": self.outlier_fraction,
        }


#: An embedding's setting under ``embedding_bits: auto`` that keeps it unquantized (no code width).
KEPT = Setting(0)
#: The settings an embedding chooses from under ``embedding_bits: auto``: every embedding width and KEPT.
#: No cap at twice the target as for the linears: an embedding is one unit whose 6 / 8 bit candidates are
#: cheap RTN rows to estimate, and a budget may well spend bits there (or keep it) rather than on a linear.
EMBEDDING_SETTINGS: tuple[Setting, ...] = (*(Setting(bits) for bits in sorted(EMBEDDING_BITS)), KEPT)


def embedding_setting_bits(
    shape: Sequence[int], weights: WeightsConfig, setting: Setting, value_bytes: int, kept_bytes: int
) -> int:
    """Stored bits of an embedding of ``shape`` (rows, dim) at ``setting`` (one of EMBEDDING_SETTINGS): the
    format's exact size accounting (``estimate_bytes``), or ``kept_bytes`` per weight for KEPT."""
    rows, cols = int(shape[0]), int(shape[1])
    if setting.kept:
        return 8 * kept_bytes * rows * cols
    quantized = embedding_recipe(Recipe(weights=weights), setting.bits).weights
    fmt = format_for_recipe(quantized)
    if fmt is None:  # embedding_recipe gives a registered method (squeeze or rtn)
        raise ValueError(f"no registered weight format for method {quantized.method!r}")
    return 8 * fmt.estimate_bytes(rows, cols, quantized, value_bytes)


def candidate_settings(weights: WeightsConfig) -> tuple[Setting, ...]:
    """The settings a budget chooses from: the widths of squeeze.limits.WEIGHT_BITS up to twice
    ``weights.target_bpw`` (all of them without one), each dense and, when the recipe has sparse fractions
    (and its format a sparse part), with them; ascending by width, dense first.

    Why the cap: a width over twice the average must be paid for by other linears far below it, and the
    8-bit candidates cost most of the estimate (k-means into 256 levels) while an 8-bit fp16 LUT alone adds
    7 bits per weight on rows of 576: at 3.5 or 2.5 bits they are never worth it; from 4 bits on they stay.
    """
    fmt = format_for_recipe(weights)
    has_sparse = fmt is not None and {"sensitive_fraction", "outlier_fraction"} <= fmt.recipe_options
    sparse = (weights.sensitive_fraction, weights.outlier_fraction)
    choices = [(0.0, 0.0)] + ([sparse] if has_sparse and any(sparse) else [])
    target = weights.target_bpw
    widths = [bits for bits in WEIGHT_BITS if target is None or bits <= 2 * target]
    return tuple(Setting(bits, s, o) for bits in widths for s, o in choices)


def fused_units(names: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` (module names, model order) grouped into units that share one setting, in model order.

    Linears of one parent module whose suffixes form one of the model families' fused groups (squeeze.models.
    families.fused_groups: vLLM's qkv_proj and gate_up_proj) are one unit (only those of the
    set that are present: a model quantizing q and k but not v fuses q and k); every other linear is its own.
    """
    units: list[tuple[str, ...]] = []
    placed: set[str] = set()
    by_name = set(names)
    for name in names:
        if name in placed:
            continue
        parent, _, leaf = name.rpartition(".")
        unit: tuple[str, ...] = (name,)
        for fused in fused_groups():
            if leaf in fused:
                members = [f"{parent}.{sub}" if parent else sub for sub in fused]
                unit = tuple(m for m in names if m in members and m in by_name)
                break
        units.append(unit)
        placed.update(unit)
    return units


def bits_range(costs: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(fewest, most) bits over all plans: each unit at its cheapest, or at its dearest, setting."""
    return sum(min(c) for c in costs), sum(max(c) for c in costs)


def check_target(
    target_bpw: float, n_weights: int, costs: Sequence[Sequence[int]], where: str, *, embeddings: bool = False
) -> int:
    """The budget in bits for ``target_bpw`` over ``n_weights``; ConfigError (with the range this model allows)
    when no plan reaches it or it is above what the largest setting stores. ``embeddings``: the costs and
    ``n_weights`` include the embeddings (``embedding_bits: auto``), which the message then says."""
    lo, hi = bits_range(costs)
    budget = math.floor(target_bpw * n_weights)
    if budget < lo or target_bpw * n_weights > hi:
        low, high = lo / n_weights, hi / n_weights
        what = "linear and embedding" if embeddings else "linear"
        counted = " (an average over the linears and the embeddings, embedding_bits auto)" if embeddings else ""
        raise ConfigError(
            f"{where} {target_bpw:g} is outside what this model's settings store{counted}: between {low:.3f} "
            f"(every {what} at its smallest setting) and {high:.3f} bits per weight (every {what} at its largest)",
            hint=f"pass a target in [{math.ceil(low * 1000) / 1000:.3f}, {math.floor(high * 1000) / 1000:.3f}]",
        )
    return budget


def estimated_bits(
    shapes: Mapping[str, Sequence[int]],
    weights: WeightsConfig,
    value_bytes: int,
    embeddings: Mapping[str, Sequence[int]] | None = None,
    kept_bytes: int = 4,
) -> tuple[list[tuple[str, ...]], list[list[int]]]:
    """(units, bits of each unit at each candidate setting) from the linears' (out, in) shapes alone, by the
    format's exact size accounting (``estimate_bytes``; ``value_bytes`` per sparse value): for preflight.
    ``embeddings`` (``embedding_bits: auto``): name -> (rows, dim), one unit each after the linears, at each
    of EMBEDDING_SETTINGS (KEPT: ``kept_bytes`` per weight)."""
    fmt = format_for_recipe(weights)
    if fmt is None:  # a WeightsConfig is validated against the registry when it is built
        raise ValueError(f"no registered weight format for method {weights.method!r}")
    settings = candidate_settings(weights)
    units = fused_units(list(shapes))
    options = [s.weights(weights) for s in settings]
    bits = [
        [
            8 * sum(fmt.estimate_bytes(int(shapes[n][0]), int(shapes[n][1]), o, value_bytes) for n in unit)
            for o in options
        ]
        for unit in units
    ]
    for name, shape in (embeddings or {}).items():
        units.append((name,))
        bits.append([embedding_setting_bits(shape, weights, s, value_bytes, kept_bytes) for s in EMBEDDING_SETTINGS])
    return units, bits


def budget_bytes(
    shapes: Mapping[str, Sequence[int]],
    weights: WeightsConfig,
    value_bytes: int,
    embeddings: Mapping[str, Sequence[int]] | None = None,
    kept_bytes: int = 4,
) -> int:
    """Most bytes the linears of ``shapes`` (and ``embeddings``, with ``embedding_bits: auto``; see
    :func:`estimated_bits`) take under ``weights.target_bpw`` (ConfigError when out of reach): a bound, the
    plan's bits never exceed it, whichever settings it picks."""
    if weights.target_bpw is None:
        raise ValueError("budget_bytes needs weights.target_bpw")
    _, bits = estimated_bits(shapes, weights, value_bytes, embeddings, kept_bytes)
    every = [*shapes.values(), *(embeddings or {}).values()]
    n_weights = sum(int(shape[0]) * int(shape[1]) for shape in every)
    budget = check_target(weights.target_bpw, n_weights, bits, "weights.target_bpw", embeddings=bool(embeddings))
    return -(-budget // 8)


def allocate(
    costs: Sequence[Sequence[int]],
    errors: Sequence[Sequence[float]],
    budget: int,
    *,
    resolution: int = DEFAULT_RESOLUTION,
) -> list[int]:
    """One choice per unit minimising the summed error with the summed cost at most ``budget``.

    costs: per unit, the stored bits of each choice (ints >= 0); errors: per unit, the error of each choice
    (finite floats), same shape. Returns the index of each unit's choice. Exact when every cost is a
    multiple of ``ceil(budget / resolution)`` (e.g. a budget of at most ``resolution``); otherwise costs are
    rounded up to that step (the plan never exceeds the budget) and what the rounding leaves is spent
    greedily on the upgrades that cut the most error per extra bit. ValueError when no choice fits.
    """
    if len(costs) != len(errors) or any(len(c) != len(e) or not c for c, e in zip(costs, errors, strict=True)):
        raise ValueError("costs and errors must have one non-empty row per unit, of equal lengths")
    if budget < sum(min(c) for c in costs):
        raise ValueError(f"no plan fits in {budget} bits: the cheapest takes {sum(min(c) for c in costs)}")
    if not costs:
        return []
    step = max(1, math.ceil(budget / resolution))
    slots = budget // step
    # best[j]: least error of the units so far with at most j steps; pick[u, j]: the choice reaching it
    best = np.zeros(slots + 1, dtype=np.float64)
    pick = np.zeros((len(costs), slots + 1), dtype=np.int16)
    for u, (unit_costs, unit_errors) in enumerate(zip(costs, errors, strict=True)):
        nxt = np.full(slots + 1, np.inf)
        for k, (cost, error) in enumerate(zip(unit_costs, unit_errors, strict=True)):
            need = -(-int(cost) // step)  # ceil: the rounded plan never exceeds the budget
            if need > slots:
                continue
            candidate = np.full(slots + 1, np.inf)
            candidate[need:] = best[: slots + 1 - need] + float(error)
            better = candidate < nxt
            nxt[better] = candidate[better]
            pick[u, better] = k
        best = nxt
    if not np.isfinite(best[slots]):  # only possible when rounding up pushed the cheapest plan over
        choice = [int(np.argmin(c)) for c in costs]
    else:
        choice = [0] * len(costs)
        j = slots
        for u in range(len(costs) - 1, -1, -1):
            k = int(pick[u, j])
            choice[u] = k
            j -= -(-int(costs[u][k]) // step)
    return _top_up(costs, errors, budget, choice)


def _top_up(
    costs: Sequence[Sequence[int]], errors: Sequence[Sequence[float]], budget: int, choice: list[int]
) -> list[int]:
    """Spend the bits the rounded plan left: repeatedly the change that cuts the most error per extra bit and
    still fits (a change that costs nothing extra and cuts error first)."""
    spent = sum(int(costs[u][k]) for u, k in enumerate(choice))
    while True:
        best_gain, best_move = 0.0, None
        for u, k in enumerate(choice):
            for j, (cost, error) in enumerate(zip(costs[u], errors[u], strict=True)):
                extra = int(cost) - int(costs[u][k])
                cut = float(errors[u][k]) - float(error)
                if cut <= 0 or spent + extra > budget:
                    continue
                gain = math.inf if extra <= 0 else cut / extra
                if gain > best_gain:
                    best_gain, best_move = gain, (u, j)
        if best_move is None:
            return choice
        u, j = best_move
        spent += int(costs[u][j]) - int(costs[u][choice[u]])
        choice[u] = j


def planned_recipe(recipe: Recipe, setting: Setting | None) -> Recipe:
    """``recipe`` with a planned linear's setting (uniform weights, no budget); ``recipe`` itself for None."""
    if setting is None:
        return recipe
    return replace(recipe, weights=setting.weights(recipe.weights))


def without_error_compensation(recipe: Recipe) -> Recipe:
    """``recipe`` with error compensation off (its options at their defaults): what a weight without an input
    Hessian (a 3-D expert parameter) and the plan's error estimates are quantized with; ``recipe`` itself
    when it has none."""
    weights = recipe.weights
    if not weights.error_compensation:
        return recipe
    base = WeightsConfig()  # error_compensation and its options at their defaults (off)
    options = {name: getattr(base, name) for name in ERROR_COMPENSATION_OPTIONS}
    plain = replace(weights, error_compensation=False, **options)
    return replace(recipe, weights=plain)


def plan_summary(plan: Mapping[str, Setting], sizes: Mapping[str, int]) -> dict[str, float]:
    """Share of the planned weights (by count, rounded to 4 places) at each setting, by label, widest last:
    {"w2": 0.05, "w3-s045": 0.62, "w4": 0.33}. ``sizes``: module name -> its weight count; planned names
    without one (the embeddings of ``embedding_bits: auto``, when the caller sizes the linears) are left out."""
    counted = {name: setting for name, setting in plan.items() if name in sizes}
    total = sum(sizes[name] for name in counted) or 1
    shares: dict[Setting, float] = {}
    for name, setting in counted.items():
        shares[setting] = shares.get(setting, 0.0) + sizes[name] / total
    return {setting.label(): round(share, 4) for setting, share in sorted(shares.items())}


__all__ = [
    "DEFAULT_RESOLUTION",
    "Setting",
    "KEPT",
    "EMBEDDING_SETTINGS",
    "embedding_setting_bits",
    "without_error_compensation",
    "candidate_settings",
    "fused_units",
    "bits_range",
    "estimated_bits",
    "budget_bytes",
    "check_target",
    "allocate",
    "planned_recipe",
    "plan_summary",
]
