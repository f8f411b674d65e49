"""``weights.target_bpw`` end to end on the tiny Llama: the plan, the artifact it gives, and every bad input.

The tiny Llama has rows of 64 columns, where a LUT row costs a lot (4 bits: 16 x 16 / 64 = 4 bits per weight
on top of the codes), so its settings span about 3 to 72 bits per weight and its 8 units (q/k/v, o,
gate/up, down of 2 blocks) are coarse steps: the plan lands at most one unit's step below the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.compression.bit_budget import Setting, candidate_settings, fused_units
from squeeze.compression.bit_plan import PLAN_NAME, ErrorTable, error_table, load_plan, plan_from_table, save_plan
from squeeze.config import Recipe, WeightsConfig, load_recipe
from squeeze.errors import ConfigError

runner = CliRunner()
TARGET = 5.0


@pytest.fixture(scope="module")
def budget_artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:  # noqa: ANN001
    out = tmp_path_factory.mktemp("budget") / "tiny-b5"
    return compress_tiny(out, "w3-s045", overrides={"weights.target_bpw": TARGET})


def quant_config(artifact: Path) -> dict:
    return json.loads((artifact / "config.json").read_text())["quantization_config"]


def test_the_artifact_meets_the_budget_with_mixed_widths_and_fused_units_share_one(budget_artifact: Path) -> None:
    quant = quant_config(budget_artifact)
    modules = quant["modules"]
    info = api.inspect(budget_artifact)
    assert info.bits_per_weight == quant["bits_per_weight"]  # measured from the shards' headers
    assert info.bits_per_weight <= TARGET
    widths = {m["bits"] for m in modules.values()}
    assert len(widths) > 1, modules  # a budget between two widths mixes them
    for unit in fused_units(list(modules)):
        assert len({modules[name]["bits"] for name in unit}) == 1, unit
        sparse = {f"{name}.weight_sparse_vals" in _tensor_names(budget_artifact) for name in unit}
        assert len(sparse) == 1, unit
    # coarse units (see the module docstring), yet the plan leaves little of the budget unused
    assert TARGET - info.bits_per_weight < 0.2, info.bits_per_weight
    # inspect says how many modules got each width
    expected = {bits: sum(m["bits"] == bits for m in modules.values()) for bits in sorted(widths)}
    assert info.widths == expected and info.to_dict()["widths"] == {str(b): n for b, n in expected.items()}
    shown = CliRunner().invoke(app, ["inspect", str(budget_artifact)], terminal_width=1000)
    assert "widths: " + ", ".join(f"{n} at {b} bits" for b, n in expected.items()) in shown.stdout, shown.output


def _tensor_names(artifact: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for shard in artifact.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            names.update(handle.keys())
    return names


def test_the_budget_artifact_loads_and_runs(budget_artifact: Path) -> None:
    loaded = api.load(budget_artifact)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert logits.shape[:2] == (1, 4) and bool(torch.isfinite(logits).all())


def test_the_recipe_records_the_target(budget_artifact: Path) -> None:
    recipe = (budget_artifact / "recipe.yaml").read_text()
    assert f"target_bpw: {TARGET}" in recipe
    header = quant_config(budget_artifact)  # no one width for the artifact: each module entry has its own
    assert header["bits"] is None and header["target_bpw"] == TARGET


# -- the plan on its own


def _toy_table() -> ErrorTable:
    settings = (Setting(2), Setting(3), Setting(4))
    units = [("a.q_proj", "a.k_proj"), ("a.o_proj",)]
    return ErrorTable(units=units, settings=settings, bits=[[40, 60, 80], [20, 30, 40]], errors=[[9, 3, 1], [4, 2, 1]])


def test_a_plan_gives_every_member_of_a_unit_its_setting() -> None:
    # 90 bits: 3 + 3 bits (60 + 30, error 5) beats 2 + 4 (80, error 10) and 3 + 2 (80, error 7)
    plan = plan_from_table(_toy_table(), 3.0, 30)
    assert plan == {"a.q_proj": Setting(3), "a.k_proj": Setting(3), "a.o_proj": Setting(3)}
    assert plan_from_table(_toy_table(), 4.0, 30)["a.q_proj"] == Setting(4)  # 120 bits: everything at 4


def test_the_plan_checkpoint_round_trips_and_a_foreign_one_is_ignored(tmp_path: Path) -> None:
    table = _toy_table()
    plan = plan_from_table(table, 3.0, 30)
    save_plan(tmp_path, plan, table)
    names = ["a.q_proj", "a.k_proj", "a.o_proj"]
    assert load_plan(tmp_path, names, table.settings) == plan
    assert load_plan(tmp_path, names[:2], table.settings) is None  # other modules
    assert load_plan(tmp_path, names, (Setting(8),)) is None  # settings this recipe does not offer
    (tmp_path / PLAN_NAME).write_text("{not json")
    assert load_plan(tmp_path, names, table.settings) is None


def test_the_error_table_counts_exact_bits_and_weighted_error() -> None:
    torch.manual_seed(0)
    weights = {"l.q_proj": torch.randn(8, 16), "l.k_proj": torch.randn(4, 16), "l.o_proj": torch.randn(8, 16)}
    fisher = {name: torch.rand_like(w) for name, w in weights.items()}
    recipe = Recipe(weights=WeightsConfig(target_bpw=3.0))
    from squeeze.compression.quantize import quantize_module

    table = error_table(weights, fisher, recipe, lambda w, f, r: quantize_module(w, f, r))
    assert table.units == [("l.q_proj", "l.k_proj"), ("l.o_proj",)]
    assert [s.bits for s in table.settings] == [2, 3, 4]  # up to twice the target
    for u, unit in enumerate(table.units):
        assert table.errors[u] == sorted(table.errors[u], reverse=True)  # more bits, less error
        for k, setting in enumerate(table.settings):
            uniform = Recipe(weights=setting.weights(recipe.weights))
            quantized = [quantize_module(weights[n], fisher[n], uniform) for n in unit]
            assert table.bits[u][k] == sum(q.storage_bits() for q in quantized)
            want = sum(
                float((fisher[n] * (weights[n] - q.dequantize()) ** 2).sum())
                for n, q in zip(unit, quantized, strict=True)
            )
            assert table.errors[u][k] == pytest.approx(want, rel=1e-6)


def test_an_estimate_on_every_fourth_row_keeps_the_bits_and_scales_the_error_up() -> None:
    torch.manual_seed(1)
    weights = {"l.o_proj": torch.randn(256, 64) * torch.rand(256, 1), "l.down_proj": torch.randn(64, 96)}
    fisher = {name: torch.rand_like(w) ** 4 for name, w in weights.items()}
    recipe = Recipe(weights=WeightsConfig(target_bpw=3.0, sensitive_fraction=0.0005, outlier_fraction=0.004))
    from squeeze.compression.quantize import quantize_module

    full = error_table(weights, fisher, recipe, lambda w, f, r: quantize_module(w, f, r))
    calls: list[int] = []

    def counting(w, f, r):  # noqa: ANN001, ANN202
        calls.append(int(w.shape[0]))
        return quantize_module(w, f, r)

    sampled = error_table(weights, fisher, recipe, counting, row_stride=4)
    assert sampled.bits == full.bits  # exact, from the format's size accounting
    assert sorted(set(calls)) == [16, 64]  # 256 rows -> 64; 64 rows -> 16 (the fewest sampled)
    for u in range(len(full.units)):
        for k in range(len(full.settings)):
            assert sampled.errors[u][k] == pytest.approx(full.errors[u][k], rel=0.25)


# -- bad input


def test_a_target_out_of_the_models_range_is_refused_with_the_range(
    tmp_path: Path, tiny_llama_dir: Path, tiny_text_file: Path
) -> None:
    for target in (2.5, 80.0):  # tiny rows: 2-bit codes plus their LUT already take ~3 bits per weight
        with pytest.raises(ConfigError, match=r"outside what this model's settings store: between \d+\.\d{3} "):
            api.compress(
                str(tiny_llama_dir),
                tmp_path / "out",
                "w3",
                str(tiny_text_file),
                overrides={"weights.target_bpw": target},
            )
        assert not (tmp_path / "out").exists()  # refused in preflight: nothing written


def test_a_target_below_two_bits_is_refused_when_the_recipe_is_read() -> None:
    for bad in (1.5, float("nan"), 0.0):
        with pytest.raises(ConfigError, match="target_bpw must be a number of at least 2"):
            load_recipe("w3", **{"weights.target_bpw": bad})


def test_bits_and_target_together_contradict_unless_one_is_a_flag_over_the_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contradict"):
        load_recipe("w3", **{"weights.bits": 4, "weights.target_bpw": 3.5})
    both = tmp_path / "both.yaml"
    both.write_text("weights:\n  bits: 3\n  target_bpw: 3.5\n")
    with pytest.raises(ConfigError, match="sets both weights.bits"):
        load_recipe(both)
    # a flag replaces the recipe's choice: --target-bpw budgets w3, --bits makes b3.5 uniform
    budgeted = load_recipe("w3-s045", **{"weights.target_bpw": 3.5}).weights
    assert budgeted.target_bpw == 3.5 and budgeted.sensitive_fraction == 0.0005
    uniform = load_recipe("b3.5", **{"weights.bits": 4}).weights
    assert uniform.target_bpw is None and uniform.bits == 4


def test_the_cli_refuses_bits_with_a_target(tmp_path: Path, tiny_llama_dir: Path) -> None:
    result = runner.invoke(
        app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--bits", "3", "--target-bpw", "3.5"]
    )
    assert result.exit_code == 2
    assert "contradict" in result.output and "Traceback" not in result.output


def test_a_resumed_budget_run_reuses_the_committed_plan_and_gives_the_same_artifact(
    tmp_path: Path,
    budget_artifact: Path,
    compress_tiny,  # noqa: ANN001
    tiny_llama_dir: Path,
    tiny_text_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import squeeze.compression.bit_plan as bit_plan
    import squeeze.compression.quantize as quantize
    from squeeze.compression.workarea import WORK_NAME

    real = quantize.quantize_group
    calls = {"groups": 0}

    def failing(job, names):  # noqa: ANN001, ANN202
        calls["groups"] += 1
        if calls["groups"] == 2:
            raise RuntimeError("killed after the first layer group")
        return real(job, names)

    out = tmp_path / "tiny-b5"
    monkeypatch.setattr(quantize, "quantize_group", failing)
    with pytest.raises(RuntimeError, match="killed"):
        compress_tiny(out, "w3-s045", overrides={"weights.target_bpw": TARGET})
    assert (out / WORK_NAME / PLAN_NAME).is_file()
    monkeypatch.setattr(quantize, "quantize_group", real)

    def no_estimate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the committed plan must be reused, not estimated again")

    monkeypatch.setattr(bit_plan, "error_table", no_estimate)
    result = api.compress(
        str(tiny_llama_dir),
        out,
        "w3-s045",
        str(tiny_text_file),
        overrides={"weights.target_bpw": TARGET},
        calibration_overrides={"num_samples": 4, "seq_len": 32},
    )
    # the summary says how the weights were spread over the settings
    assert result.plan is not None and sum(result.plan.values()) == pytest.approx(1.0, abs=1e-3)
    assert set(result.plan) <= {s.label() for s in candidate_settings(load_recipe("w3-s045").weights)}
    assert result.to_dict()["plan"] == result.plan and result.bits_per_weight <= TARGET
    shards = sorted(p.name for p in budget_artifact.glob("*.safetensors"))
    assert shards and all((out / n).read_bytes() == (budget_artifact / n).read_bytes() for n in shards)
    assert quant_config(out) == quant_config(budget_artifact)
