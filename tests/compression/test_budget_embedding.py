"""Issue 18, item 4: ``weights.embedding_bits: auto`` puts the token embedding (and an untied LM head) into
the ``target_bpw`` budget as units of their own: kept in the unquantized dtype, or 8, 6 or 4 bits, the
average then taken over the linears' and the embeddings' weights together.

Golden tables through the allocator, the error table's exact bits against the quantized embeddings, and
tiny compressions where the budget quantizes the embeddings (low target) or keeps them (high target), both
loading equal to the dense reference of their own dequantized weights, and resuming to the same plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.compression.bit_budget import (
    EMBEDDING_SETTINGS,
    KEPT,
    Setting,
    budget_bytes,
    estimated_bits,
    plan_summary,
)
from squeeze.compression.bit_plan import PLAN_NAME, ErrorTable, error_table, load_plan, plan_from_table, save_plan
from squeeze.compression.embeddings import embedding_recipe
from squeeze.compression.preflight import estimate_size, meta_model
from squeeze.compression.quantize import quantize_module
from squeeze.config import Recipe, WeightsConfig, load_recipe
from squeeze.errors import ConfigError
from squeeze.models.source import resolve_model
from squeeze.runtime.embedding import SqueezeEmbedding
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.stored_dtype import Float32OutputEmbedding

IDS = torch.tensor([[1, 5, 9, 30, 40, 50, 7, 7]])
EMBEDDINGS = ("model.embed_tokens", "lm_head")  # the tiny Llama's: untied
LOW, HIGH = 5.0, 40.0  # bits per weight: the tiny Llama's embeddings quantized (6 bits) / kept (bfloat16)
KEEP_BF16 = {"output.keep_dtype": "bfloat16"}


# -- the recipe


def test_b4_e_is_b3_5_e_at_four_bits() -> None:
    small, large = load_recipe("b3.5-e").to_dict(), load_recipe("b4-e").to_dict()
    assert (small["weights"].pop("target_bpw"), large["weights"].pop("target_bpw")) == (3.5, 4.0)
    assert (small.pop("name"), large.pop("name")) == ("b3.5-e", "b4-e")
    assert small == large


def test_auto_needs_a_budget_and_other_values_are_refused() -> None:
    assert load_recipe("b3.5-e").weights.embedding_bits == "auto"
    assert load_recipe("b3.5-e").weights.target_bpw == 3.5
    with pytest.raises(ConfigError, match="embedding_bits auto needs weights.target_bpw") as caught:
        load_recipe("w4", **{"weights.embedding_bits": "auto"})
    assert "--target-bpw" in (caught.value.hint or "")
    with pytest.raises(ConfigError, match="needs weights.target_bpw"):  # --bits makes the budget recipe uniform
        load_recipe("b3.5-e", **{"weights.bits": 4})
    for bad in ("sometimes", 5, True, 4.0):
        with pytest.raises(ConfigError, match="embedding_bits"):
            load_recipe("b3.5", **{"weights.embedding_bits": bad})
    assert load_recipe("b3.5", **{"weights.embedding_bits": 6}).weights.embedding_bits == 6


def test_the_cli_takes_auto_and_widths(tmp_path: Path, tiny_llama_dir: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(
        app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--embedding-bits", "auto"]
    )
    assert refused.exit_code == 2 and "needs weights.target_bpw" in refused.output, refused.output
    wrong = runner.invoke(app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--embedding-bits", "5"])
    assert wrong.exit_code == 2 and "must be one of [4, 6, 8, 'auto']" in wrong.output, wrong.output
    assert "Traceback" not in refused.output + wrong.output and not (tmp_path / "o").exists()


# -- the plan


def _golden_table() -> ErrorTable:
    """Linears of 30 weights (q+k: 20, o: 10) and an embedding of 10: its candidates 4, 6, 8 bits and kept."""
    return ErrorTable(
        units=[("a.q_proj", "a.k_proj"), ("a.o_proj",), ("model.embed_tokens",)],
        settings=(Setting(2), Setting(3), Setting(4)),
        bits=[[40, 60, 80], [20, 30, 40], [40, 60, 80, 160]],
        errors=[[9, 3, 1], [4, 2, 1], [6, 2, 1, 0]],
        embeddings=("model.embed_tokens",),
    )


def test_the_plan_chooses_the_embedding_among_its_four_settings_within_the_whole_budget() -> None:
    assert [s.label() for s in EMBEDDING_SETTINGS] == ["w4", "w6", "w8", "kept"]
    table = _golden_table()
    assert table.candidates(("model.embed_tokens",)) == EMBEDDING_SETTINGS
    # 3.0 x 40 = 120 bits: the cheapest plan (100) plus 20, best spent on q/k at 3 bits (error 13, vs 15 with
    # the embedding at 6 bits or 17 with o at 3)
    plan = plan_from_table(table, 3.0, 40)
    assert plan == {
        "a.q_proj": Setting(3),
        "a.k_proj": Setting(3),
        "a.o_proj": Setting(2),
        "model.embed_tokens": Setting(4),
    }
    # 240 of the 280 the largest take: the embedding at 8 bits (error 3) beats keeping it and cutting linears (7)
    assert plan_from_table(table, 6.0, 40)["model.embed_tokens"] == Setting(8)
    assert plan_from_table(table, 7.0, 40)["model.embed_tokens"] == KEPT  # everything at its largest
    # the denominator counts the embedding: 2.5 x 40 = 100 is reachable, and refused over 30 or 2.4 x 40
    assert plan_from_table(table, 2.5, 40)["a.q_proj"] == Setting(2)
    for target, n_weights in ((2.5, 30), (2.4, 40)):
        with pytest.raises(ConfigError, match=r"over the linears and the embeddings.*every linear and embedding"):
            plan_from_table(table, target, n_weights)
    # the summary of the linears leaves the embedding out
    assert plan_summary(plan, {"a.q_proj": 10, "a.k_proj": 10, "a.o_proj": 10}) == {"w2": 0.3333, "w3": 0.6667}


def test_the_plan_checkpoint_covers_the_embeddings(tmp_path: Path) -> None:
    table = _golden_table()
    plan = plan_from_table(table, 7.0, 40)
    save_plan(tmp_path, plan, table)
    linears, settings = ["a.q_proj", "a.k_proj", "a.o_proj"], table.settings
    assert load_plan(tmp_path, linears, settings, ["model.embed_tokens"]) == plan
    assert load_plan(tmp_path, linears, settings) is None  # a recipe with a fixed embedding width: not its plan
    record = json.loads((tmp_path / PLAN_NAME).read_text())
    assert record["table"]["embedding_settings"] == ["w4", "w6", "w8", "kept"]
    record["modules"]["a.o_proj"] = KEPT.to_dict()  # a linear cannot be kept
    (tmp_path / PLAN_NAME).write_text(json.dumps(record))
    assert load_plan(tmp_path, linears, settings, ["model.embed_tokens"]) is None


def test_the_error_table_gives_each_embedding_setting_its_exact_bits_and_weighted_error() -> None:
    torch.manual_seed(0)
    weights = {"l.o_proj": torch.randn(8, 16)}
    table_weight = torch.randn(40, 64)  # rows of more than 16 values: a 4-bit LUT is not exact
    fisher = {"l.o_proj": torch.rand(8, 16), "embed": torch.rand(40, 64)}
    recipe = Recipe(weights=WeightsConfig(target_bpw=3.0, embedding_bits="auto"))

    def quantize(w: torch.Tensor, f: torch.Tensor | None, r: Recipe) -> Any:
        return quantize_module(w, f, r)

    table = error_table(weights, fisher, recipe, quantize, embeddings={"embed": table_weight}, kept_bytes=2)
    assert table.units == [("l.o_proj",), ("embed",)] and table.embeddings == ("embed",)
    bits, errors = table.bits[1], table.errors[1]
    for k, setting in enumerate(EMBEDDING_SETTINGS):
        if setting == KEPT:
            assert (bits[k], errors[k]) == (16 * table_weight.numel(), 0.0)
            continue
        q = quantize_module(table_weight, fisher["embed"], embedding_recipe(recipe, setting.bits))
        assert bits[k] == q.storage_bits()
        want = float((fisher["embed"] * (table_weight - q.dequantize()) ** 2).sum())
        assert errors[k] == pytest.approx(want, rel=1e-6)
    assert errors[0] > errors[1] > errors[2] > errors[3] == 0  # more bits, less error
    # preflight's accounting from the shapes alone is the same
    units, estimated = estimated_bits({"l.o_proj": (8, 16)}, recipe.weights, 4, {"embed": (40, 64)}, kept_bytes=2)
    assert units == table.units and estimated == table.bits


def test_preflight_counts_the_embeddings_in_the_budget_not_among_the_other_tensors(tiny_llama_dir: Path) -> None:
    skeleton = meta_model(resolve_model(str(tiny_llama_dir)))
    fixed = estimate_size(skeleton, load_recipe("b3.5", **{"weights.target_bpw": LOW}))
    auto = estimate_size(skeleton, load_recipe("b3.5-e", **{"weights.target_bpw": LOW}))
    embedding = skeleton.get_input_embeddings().weight.numel()
    assert fixed.other_bytes - auto.other_bytes == 2 * embedding * 4  # the untied pair, fp32
    shapes = {n: tuple(m.weight.shape) for n, m in skeleton.named_modules() if n.endswith(("_proj",))}
    linears = sum(s[0] * s[1] for s in shapes.values())
    assert auto.quantized_bytes == -(-int(LOW * (linears + 2 * embedding)) // 8)
    assert auto.quantized_bytes == budget_bytes(
        shapes,
        load_recipe("b3.5-e", **{"weights.target_bpw": LOW}).weights,
        4,
        {name: (320, 64) for name in EMBEDDINGS},
    )


# -- compress end to end


def _quant(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / "config.json").read_text())["quantization_config"]


def _tensors(artifact: Path) -> dict[str, tuple[str, int, int]]:
    """tensor name -> (dtype, element count, bytes), from the shards."""
    found: dict[str, tuple[str, int, int]] = {}
    for shard in artifact.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                found[key] = (str(f.get_slice(key).get_dtype()), t.numel(), t.numel() * t.element_size())
    return found


def _planned_bits_per_weight(artifact: Path) -> float:
    """Bits of the quantized modules and the kept embeddings over their weights: what the budget bounds."""
    quant, tensors = _quant(artifact), _tensors(artifact)
    bits = weights = 0
    for name, spec in quant["modules"].items():
        bits += 8 * sum(size for key, (_, _, size) in tensors.items() if key.startswith(f"{name}.weight"))
        weights += spec["out_features"] * spec["in_features"]
    for name in EMBEDDINGS:
        if name not in quant["modules"]:
            _, count, size = tensors[f"{name}.weight"]
            bits, weights = bits + 8 * size, weights + count
    return bits / weights


def _dense_reference(source: Path, loaded: nn.Module) -> nn.Module:
    """The source model with every quantized weight replaced by the loaded artifact's dequantization, every other
    tensor as the artifact stores it."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    state = {k: v for k, v in loaded.state_dict().items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    for name, module in loaded.named_modules():
        if isinstance(module, (SqueezeLinear, SqueezeEmbedding)):
            state[f"{name}.weight"] = module.dequantize()
    reference.load_state_dict(state, strict=False)
    return reference


def _check_loads_as_reference(artifact: Path, source: Path) -> nn.Module:
    model = api.load(artifact).model
    with torch.no_grad():
        logits = model(IDS).logits
        reference = _dense_reference(source, model)(IDS).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    return model


@pytest.fixture(scope="module")
def low(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("low") / "art", "b3.5-e", overrides={"weights.target_bpw": LOW})


@pytest.fixture(scope="module")
def high(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    overrides = {"weights.target_bpw": HIGH, **KEEP_BF16}
    return compress_tiny(tmp_path_factory.mktemp("high") / "art", "b3.5-e", overrides=overrides)


def test_a_low_target_quantizes_the_embeddings_at_their_planned_width(low: Path, tiny_llama_dir: Path) -> None:
    quant = _quant(low)
    entry = quant["embeddings"]
    assert entry["modules"] == list(EMBEDDINGS) and entry["tied"] == {}
    planned = {name: quant["modules"][name]["bits"] for name in EMBEDDINGS}
    assert entry["bits"] == (next(iter(planned.values())) if len(set(planned.values())) == 1 else planned)
    assert set(planned.values()) <= {4, 6, 8}
    # the embeddings counted in the average: within it, and most of it spent (over the linears alone the budget
    # would be a third smaller)
    assert 0 <= LOW - _planned_bits_per_weight(low) < 0.2
    assert quant["bits_per_weight"] == pytest.approx(_planned_bits_per_weight(low), abs=1e-3)
    model = _check_loads_as_reference(low, tiny_llama_dir)
    assert isinstance(model.get_input_embeddings(), SqueezeEmbedding)
    assert isinstance(model.get_output_embeddings(), SqueezeLinear)


def test_a_high_target_keeps_the_embeddings_in_the_unquantized_dtype(high: Path, tiny_llama_dir: Path) -> None:
    quant, tensors = _quant(high), _tensors(high)
    assert "embeddings" not in quant  # as for embedding_bits null
    for name in EMBEDDINGS:
        assert name not in quant["modules"] and tensors[f"{name}.weight"][0] == "BF16"
        assert f"{name}.weight_packed" not in tensors
    # kept: 16 bits per weight, in the budget (the tiny units are coarse: a linear at 8 bits costs 64 more per
    # weight than at 4, with its 256-entry LUT on rows of 64)
    assert 0 <= HIGH - _planned_bits_per_weight(high) < 2.0
    model = _check_loads_as_reference(high, tiny_llama_dir)
    embedding = model.get_input_embeddings()  # unquantized, held as stored (squeeze.runtime.stored_dtype)
    assert type(embedding) is Float32OutputEmbedding and embedding.weight.dtype == torch.bfloat16


def test_a_tied_pair_is_one_unit_quantized_once(
    tmp_path: Path, resized_tiny_llama: Callable[..., Path], compress_tiny: Callable[..., Path]
) -> None:
    tied = resized_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    artifact = compress_tiny(tmp_path / "art", "b3.5-e", source=tied, overrides={"weights.target_bpw": LOW})
    quant = _quant(artifact)
    entry = quant["embeddings"]
    assert entry["modules"] == ["model.embed_tokens"] and entry["tied"] == {"lm_head": "model.embed_tokens"}
    assert entry["bits"] == quant["modules"]["model.embed_tokens"]["bits"] and "lm_head" not in quant["modules"]
    model = _check_loads_as_reference(artifact, tied)
    assert model.get_output_embeddings().weight_packed is model.get_input_embeddings().weight_packed


def test_a_resumed_auto_run_reuses_the_committed_plan(
    tmp_path: Path,
    compress_tiny: Callable[..., Path],
    tiny_llama_dir: Path,
    tiny_text_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import squeeze.compression.bit_plan as bit_plan
    import squeeze.compression.quantize as quantize
    from squeeze.compression.workarea import WORK_NAME

    overrides = {"weights.target_bpw": 16.0, **KEEP_BF16}  # the tiny Llama: one embedding kept, one quantized
    whole = compress_tiny(tmp_path / "whole", "b3.5-e", overrides=overrides)
    real, calls = quantize.quantize_group, {"groups": 0}

    def failing(job, names):  # noqa: ANN001, ANN202
        calls["groups"] += 1
        if calls["groups"] == 2:
            raise RuntimeError("killed after the first layer group")
        return real(job, names)

    out = tmp_path / "resumed"
    monkeypatch.setattr(quantize, "quantize_group", failing)
    with pytest.raises(RuntimeError, match="killed"):
        compress_tiny(out, "b3.5-e", overrides=overrides)
    plan = json.loads((out / WORK_NAME / PLAN_NAME).read_text())["modules"]
    assert set(EMBEDDINGS) <= set(plan)  # kept or not, the embeddings are in the committed plan
    assert sorted(plan[name]["bits"] for name in EMBEDDINGS)[0] == 0  # one kept: the run drops it on resume too
    monkeypatch.setattr(quantize, "quantize_group", real)

    def no_estimate(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the committed plan must be reused, not estimated again")

    monkeypatch.setattr(bit_plan, "error_table", no_estimate)
    api.compress(
        str(tiny_llama_dir),
        out,
        "b3.5-e",
        str(tiny_text_file),
        overrides=overrides,
        calibration_overrides={"num_samples": 4, "seq_len": 32},
    )
    assert _quant(out) == _quant(whole)
    shards = sorted(p.name for p in whole.glob("*.safetensors"))
    assert shards and all((out / n).read_bytes() == (whole / n).read_bytes() for n in shards)
