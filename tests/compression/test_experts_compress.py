"""compress of tiny MoE models (random, from transformers configs): the expert parameters are quantized as one
(E*out, in) matrix each, exactly as a per-expert reference quantization with the same Fisher; unreachable
experts are counted and warned about; error compensation, budgets and resume work with experts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

import squeeze.compression.assemble as assemble
from squeeze import api
from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.quantize import quantize_module
from squeeze.config import load_calibration_spec, load_recipe
from squeeze.models.expert_params import ExpertWeight, stack_experts, unstack_experts
from squeeze.models.source import load_model, resolve_model
from squeeze.models.targets import find_targets
from squeeze.quant.schemes import format_for_module

E = 4
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
QWEN3_MOE = {"num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}
GPT_OSS = {
    "num_local_experts": E,
    "num_experts_per_tok": 2,
    "head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 4,
}
CALIB = {"num_samples": 2, "seq_len": 32}
UNREACHABLE = 3  # gpt-oss layer 1: this expert's router bias keeps it out of every top-k


def _save(root: Path, config: Any, tokenizer: Any, unreachable: bool = False) -> Path:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    if unreachable:
        with torch.no_grad():
            model.model.layers[1].mlp.router.bias[UNREACHABLE] = -1e4
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    config = tf.Qwen3MoeConfig(**{**DIMS, "vocab_size": len(tiny_tokenizer), **QWEN3_MOE})
    return _save(tmp_path_factory.mktemp("qwen3-moe") / "model", config, tiny_tokenizer)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    config = tf.GptOssConfig(**{**DIMS, "vocab_size": len(tiny_tokenizer), **GPT_OSS})
    return _save(tmp_path_factory.mktemp("gpt-oss") / "model", config, tiny_tokenizer, unreachable=True)


def _compress(source: Path, out: Path, text: Path, recipe: str = "w4", **kwargs: Any) -> api.CompressResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kwargs.setdefault("calibration", str(text))
        kwargs.setdefault("calibration_overrides", CALIB)
        return api.compress(str(source), out, recipe=recipe, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _artifact(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors, json.loads((out / "config.json").read_text())["quantization_config"]


def _dequantized(tensors: dict[str, torch.Tensor], name: str, spec: dict[str, Any]) -> torch.Tensor:
    """The artifact's (E*out, in) matrix of ``name``, by the format its entry and tensors name."""
    dtypes = {key.removeprefix(name + "."): t.dtype for key, t in tensors.items() if key.startswith(name + ".")}
    fmt = format_for_module(spec["method"], dtypes)
    assert fmt is not None
    entry = {k: v for k, v in spec.items() if k not in ("experts", "transposed")}
    return fmt.from_spec(tensors, name, entry).dequantize()


def _reference_fisher(source: Path, text: Path, recipe: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The targets and their Fisher, computed as compress does (same windows, same targets)."""
    model, tokenizer = load_model(resolve_model(str(source)), dtype=torch.float32)
    weights = load_recipe(recipe).weights
    targets = find_targets(model, weights.targets, weights.ignore)
    windows = calibration_windows(load_calibration_spec(str(text), **CALIB, seed=0), tokenizer)
    modules: dict[str, Any] = dict(targets)
    return targets, fisher_information(model, windows, modules)


def test_a_qwen3_moe_artifact_holds_each_expert_parameter_as_a_per_expert_quantization(
    qwen3_moe: Path, tmp_path: Path, tiny_text_file: Path
) -> None:
    result = _compress(qwen3_moe, tmp_path / "out", tiny_text_file)
    tensors, quant = _artifact(tmp_path / "out")
    experts = [name for name, spec in quant["modules"].items() if "experts" in spec]
    assert sorted(experts) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )
    assert result.experts == 2 * E and result.unrouted_experts == 0
    assert result.to_dict()["experts"] == 2 * E and result.to_dict()["unrouted_experts"] == 0
    targets, fisher = _reference_fisher(qwen3_moe, tiny_text_file, "w4")
    recipe = load_recipe("w4")
    for name in experts:
        spec, target = quant["modules"][name], targets[name]
        assert isinstance(target, ExpertWeight)
        assert name not in tensors  # the 3-D parameter itself is not written
        assert {k for k in tensors if k.startswith(name + ".")} == {f"{name}.weight_packed", f"{name}.weight_lut"}
        out, cols = target.expert_rows, target.columns
        assert spec["experts"] == E and spec["transposed"] is False
        assert (spec["out_features"], spec["in_features"], spec["bits"]) == (E * out, cols, 4)
        stored = _dequantized(tensors, name, spec)
        param = target.weight.detach().float()
        for e in range(E):  # the reference: expert e's (out, in) matrix quantized alone, with its own Fisher
            reference = quantize_module(param[e], fisher[name][e], recipe).dequantize()
            assert torch.equal(stored[e * out : (e + 1) * out], reference), (name, e)
        assert (stored - stack_experts(param, False)).abs().max() < 0.1  # and it is near the weights


def test_an_expert_no_calibration_token_reaches_is_counted_warned_and_quantized_uniformly(
    gpt_oss: Path, tmp_path: Path, tiny_text_file: Path
) -> None:
    with pytest.warns(UserWarning, match=r"1 of 8 experts were never routed.*layers\.1\.mlp\.experts \[3\]"):
        result = _compress(gpt_oss, tmp_path / "out", tiny_text_file)
    assert (result.experts, result.unrouted_experts) == (2 * E, 1)
    tensors, quant = _artifact(tmp_path / "out")
    name = "model.layers.1.mlp.experts.down_proj"
    spec = quant["modules"][name]
    assert spec["experts"] == E and spec["transposed"] is True
    # gpt-oss's expert biases and router stay plain tensors under their own names
    for plain in ("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.weight", "router.bias"):
        assert f"model.layers.1.mlp.{plain}" in tensors
    targets, fisher = _reference_fisher(gpt_oss, tiny_text_file, "w4")
    target = targets[name]
    assert isinstance(target, ExpertWeight)
    assert not fisher[name][UNREACHABLE].any() and fisher[name][0].any()
    stored = unstack_experts(_dequantized(tensors, name, spec), E, True)  # back to the parameter's layout
    param = target.weight.detach().float()
    recipe = load_recipe("w4")
    # the unreached expert: uniform weights, exactly as a Fisher-free k-means; a reached one: its Fisher
    uniform = quantize_module(param[UNREACHABLE].T.contiguous(), None, recipe).dequantize()
    assert torch.equal(stored[UNREACHABLE].T, uniform)
    weighted = quantize_module(param[0].T.contiguous(), fisher[name][0].T.contiguous(), recipe).dequantize()
    assert torch.equal(stored[0].T, weighted)


def test_error_compensation_leaves_the_experts_as_the_plain_recipe_quantizes_them(
    qwen3_moe: Path, tmp_path: Path, tiny_text_file: Path
) -> None:
    _compress(qwen3_moe, tmp_path / "plain", tiny_text_file, "w4")
    _compress(qwen3_moe, tmp_path / "ec", tiny_text_file, "w4-ec")
    (plain, _), (ec, quant) = _artifact(tmp_path / "plain"), _artifact(tmp_path / "ec")
    experts = [name for name, spec in quant["modules"].items() if "experts" in spec]
    assert len(experts) == 4
    for key in plain:  # expert tensors: the same bytes; the attention linears: compensated, so different
        if ".experts." in key:
            assert torch.equal(plain[key], ec[key]), key
    assert not torch.equal(
        plain["model.layers.0.self_attn.q_proj.weight_packed"], ec["model.layers.0.self_attn.q_proj.weight_packed"]
    )


def test_a_budget_plans_expert_parameters_like_linears(qwen3_moe: Path, tmp_path: Path, tiny_text_file: Path) -> None:
    result = _compress(
        qwen3_moe, tmp_path / "out", tiny_text_file, "b3.5", overrides={"weights.sensitivity": "uniform"}
    )
    _, quant = _artifact(tmp_path / "out")
    widths = {quant["modules"][name]["bits"] for name in quant["modules"] if ".experts." in name}
    assert widths and widths <= {2, 3, 4}
    assert result.bits_per_weight <= 3.5 and result.plan is not None
    assert result.experts == 2 * E and result.unrouted_experts == 0  # uniform: nothing says who is unreached


def test_a_run_interrupted_after_quantizing_resumes_to_the_same_bytes_and_counts(
    gpt_oss: Path, tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(UserWarning, match="1 of 8 experts"):
        _compress(gpt_oss, tmp_path / "whole", tiny_text_file)

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("simulated crash in the write stage")

    with monkeypatch.context() as patch:
        patch.setattr(assemble, "write_tensors", broken)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _compress(gpt_oss, tmp_path / "resumed", tiny_text_file)
    with pytest.warns(UserWarning, match="1 of 8 experts"):  # counted again, from the group checkpoints
        resumed = _compress(gpt_oss, tmp_path / "resumed", tiny_text_file)
    assert "kmeans" not in resumed.timings  # every group, experts included, came from its checkpoint
    assert (resumed.experts, resumed.unrouted_experts) == (2 * E, 1)

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.safetensors")}

    assert digests(tmp_path / "whole") == digests(tmp_path / "resumed")


def test_experts_only_targets_with_error_compensation_need_no_hessian(
    qwen3_moe: Path, tmp_path: Path, tiny_text_file: Path
) -> None:
    overrides = {"weights.targets": ["experts.gate_up_proj", "experts.down_proj"], "weights.generated_samples": 4}
    result = _compress(qwen3_moe, tmp_path / "out", tiny_text_file, "w4-ec", overrides=overrides)
    _, quant = _artifact(tmp_path / "out")
    assert sorted(quant["modules"]) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )
    assert result.quantized_modules == 4 and "ec" not in result.timings
    assert "generate" not in result.timings  # no Hessian to add sampled text to: nothing is sampled


def test_preflight_estimates_count_the_expert_parameters_exactly(
    qwen3_moe: Path, tmp_path: Path, tiny_text_file: Path
) -> None:
    from squeeze.compression.preflight import estimate_peak_memory, estimate_size, meta_model

    skeleton = meta_model(resolve_model(str(qwen3_moe)))
    recipe = load_recipe("w4")
    estimate = estimate_size(skeleton, recipe)
    dense = load_recipe("w4", **{"weights.targets": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    result = _compress(qwen3_moe, tmp_path / "out", tiny_text_file)
    tensors, quant = _artifact(tmp_path / "out")
    stored = sum(
        t.numel() * t.element_size() for key, t in tensors.items() if key.rpartition(".")[0] in quant["modules"]
    )
    assert estimate.n_quantized_weights == result.quantized_weights
    assert estimate.n_targets == len(quant["modules"]) == 12  # 4 attention linears + 2 expert parameters, x2
    assert estimate.quantized_bytes == stored  # exact: codes and LUTs of every (expert, row)
    # the peak memory counts the expert weights' Fisher accumulators too
    assert estimate_peak_memory(skeleton, recipe, 32) > estimate_peak_memory(skeleton, dense, 32)
