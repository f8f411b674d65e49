"""The bits-per-weight allocator on synthetic tables: exact against brute force, budget held, fused units."""

from __future__ import annotations

import itertools
import random

import pytest

from squeeze.compression.bit_budget import (
    Setting,
    allocate,
    candidate_settings,
    check_target,
    fused_units,
    planned_recipe,
    without_error_compensation,
)
from squeeze.config import ERROR_COMPENSATION_OPTIONS, Recipe, WeightsConfig, load_recipe
from squeeze.errors import ConfigError


def brute_force(costs: list[list[int]], errors: list[list[float]], budget: int) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        if sum(costs[u][k] for u, k in enumerate(choice)) <= budget:
            best = min(best, sum(errors[u][k] for u, k in enumerate(choice)))
    return best


def random_table(rng: random.Random, units: int, choices: int) -> tuple[list[list[int]], list[list[float]]]:
    costs, errors = [], []
    for _ in range(units):
        size = rng.randint(5, 40)
        bits = sorted(rng.sample(range(2, 12), choices))
        costs.append([size * b + rng.randint(0, 9) for b in bits])
        # more bits, less error (not convex: greedy on marginal gains is not exact here, the DP is)
        errors.append(sorted((rng.random() * size * 4.0**-b for b in bits), reverse=True))
    return costs, errors


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_is_the_brute_force_optimum_and_fits(seed: int) -> None:
    rng = random.Random(seed)
    costs, errors = random_table(rng, units=5, choices=4)
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = rng.randint(lo, hi)
    choice = allocate(costs, errors, budget)
    spent = sum(costs[u][k] for u, k in enumerate(choice))
    assert spent <= budget
    assert sum(errors[u][k] for u, k in enumerate(choice)) == pytest.approx(brute_force(costs, errors, budget))


@pytest.mark.parametrize("seed", range(4))
def test_a_coarse_budget_stays_within_it_and_close_to_the_optimum(seed: int) -> None:
    # resolution 64 << budget: costs are rounded up to steps, then the top-up spends the rest
    rng = random.Random(100 + seed)
    costs, errors = random_table(rng, units=6, choices=3)
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = (lo + hi) // 2
    choice = allocate(costs, errors, budget, resolution=64)
    assert sum(costs[u][k] for u, k in enumerate(choice)) <= budget
    best = brute_force(costs, errors, budget)
    assert sum(errors[u][k] for u, k in enumerate(choice)) <= best * 1.5 + 1e-12


def test_a_budget_below_the_cheapest_plan_is_a_contract_error() -> None:
    with pytest.raises(ValueError, match="no plan fits"):
        allocate([[10, 20], [10, 20]], [[1.0, 0.5], [1.0, 0.5]], 19)
    assert allocate([[10, 20], [10, 20]], [[1.0, 0.5], [1.0, 0.5]], 20) == [0, 0]
    assert allocate([[10, 20], [10, 20]], [[1.0, 0.5], [1.0, 0.9]], 30) == [1, 0]  # the bigger cut first
    assert allocate([], [], 0) == []


def test_fused_projections_are_one_unit_in_model_order() -> None:
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",  # v_proj not quantized in this block: q and k still share
        "model.layers.1.mlp.up_proj",
    ]
    assert fused_units(names) == [
        tuple(names[0:3]),
        (names[3],),
        (names[4], names[5]),
        (names[6],),
        (names[7], names[8]),
        (names[9],),
    ]


def test_candidates_are_every_width_dense_and_with_the_recipes_sparse_part() -> None:
    dense = WeightsConfig(bits=3)
    assert candidate_settings(dense) == tuple(Setting(b) for b in (2, 3, 4, 8))
    sparse = WeightsConfig(bits=3, sensitive_fraction=0.0005, outlier_fraction=0.004)
    got = candidate_settings(sparse)
    assert len(got) == 8 and Setting(3, 0.0005, 0.004) in got and Setting(3) in got
    assert [s.label() for s in got[:2]] == ["w2", "w2-s045"]
    rtn = WeightsConfig(method="rtn", bits=4)
    assert candidate_settings(rtn) == tuple(Setting(b) for b in (2, 3, 4, 8))
    # a budget offers the widths up to twice its average: 8 bits only from a target of 4
    assert [s.bits for s in candidate_settings(WeightsConfig(target_bpw=3.5))] == [2, 3, 4]
    assert [s.bits for s in candidate_settings(WeightsConfig(target_bpw=2.0))] == [2, 3, 4]
    assert [s.bits for s in candidate_settings(WeightsConfig(target_bpw=4.0))] == [2, 3, 4, 8]


def test_a_planned_recipe_is_uniform() -> None:
    recipe = Recipe(weights=WeightsConfig(target_bpw=3.5, sensitive_fraction=0.0005, outlier_fraction=0.004))
    planned = planned_recipe(recipe, Setting(2))
    assert planned.weights.bits == 2 and planned.weights.target_bpw is None
    assert planned.weights.sensitive_fraction == 0.0 and planned.weights.lut_dtype == recipe.weights.lut_dtype
    assert planned_recipe(recipe, None) is recipe


def test_a_target_outside_the_models_range_names_the_range() -> None:
    costs = [[100, 150, 200], [100, 150, 200]]  # 2 x 50 weights: 2.0 to 4.0 bits per weight
    assert check_target(3.5, 100, costs, "weights.target_bpw") == 350
    for bad in (1.99, 4.01):
        with pytest.raises(ConfigError, match=r"between 2\.000 .* and 4\.000 bits per weight") as caught:
            check_target(bad, 100, costs, "weights.target_bpw")
        assert caught.value.hint == "pass a target in [2.000, 4.000]"


def test_without_error_compensation_resets_every_option_of_it():
    """What an expert parameter and the plan's estimates are quantized with: a valid recipe with each
    error-compensation option at its default, whatever the recipe set."""
    common = {"damp": 0.1, "act_order": True, "generated_samples": 8}
    lnq = {"lnq_rounds": 2, "lnq_ridge": 0.5, "lnq_shrink": 0.3, "lnq_held_out": 2}
    refits = {"refit_lut", "refit_rounds", *lnq}
    # refit_lut, refit_rounds and lnq_rounds exclude each other: each is set in one of the recipes
    for refit in ({"refit_lut": True}, {"refit_rounds": 2}, lnq):
        options = common | refit
        assert set(options) | refits == set(ERROR_COMPENSATION_OPTIONS)
        recipe = load_recipe("w3-ec", **{f"weights.{k}": v for k, v in options.items()})
        assert all(getattr(recipe.weights, k) == v for k, v in options.items())
        plain = without_error_compensation(recipe).weights
        base = WeightsConfig()
        assert not plain.error_compensation
        assert all(getattr(plain, name) == getattr(base, name) for name in ERROR_COMPENSATION_OPTIONS)
        assert (plain.bits, plain.sensitivity) == (recipe.weights.bits, recipe.weights.sensitivity)
    assert without_error_compensation(load_recipe("w3")) == load_recipe("w3")
