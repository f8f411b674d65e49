"""Every MoE family transformers ships goes through the one loader: compress, verify, run, eval, from_pretrained.

The MoE counterpart of test_families.py. Tiny random models are built from each family's config class (no
downloads: hidden 64, 2 layers, 4 routed experts, top-2) and saved with the in-memory tokenizer of
conftest.py. Routed experts are 3-D parameters of one experts module (gpt-oss: transposed, with biases);
squeeze quantizes each as one (E*out, in) matrix and the runtime keeps it compressed (SqueezeExperts). The
logits of squeeze.load's model and of ``AutoModelForCausalLM.from_pretrained(artifact)`` must equal, within
1e-4, those of the reference: the original model with each quantized linear AND expert parameter replaced by
the artifact's dequantized weight (reshaped back to the parameter's layout). Routers and gates stay in full
precision; shared experts (Qwen2-MoE, DeepSeek-V3, GLM-4-MoE), DeepSeek-V3's dense first layer and its MLA
projections are ordinary linears.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn
from typer.testing import CliRunner

from family_checks import check_squeeze_eval, check_squeeze_run, compress_tiny_model, logits
from squeeze import api
from squeeze.cli.app import app
from squeeze.runtime.experts import SqueezeExperts
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.weight_paths import set_activations

runner = CliRunner()
ATOL = 1e-4
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 300, 12, 2, 45, 200]])  # 16 tokens
PROMPT = "Once upon a time there was a little"
EVAL_SEQ_LEN, EVAL_WINDOWS = 16, 3
EXPERTS, TOP_K = 4, 2
DIMS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
FISHER = {"calibration_overrides": {"num_samples": 2, "seq_len": 32}}  # Fisher from 2 windows of 32 tokens
UNIFORM = {"overrides": {"weights.sensitivity": "uniform"}}
#: Linears every family quantizes by default (attention, MLA, dense and shared-expert MLPs) and expert parameters.
LINEAR_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LINEAR_TARGETS |= {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
EXPERT_TARGETS = {"gate_up_proj", "down_proj"}


@dataclass(frozen=True)
class Family:
    """A family's config class and settings, and the recipe (with api.compress keywords) it is compressed with."""

    config: type
    settings: dict[str, Any]
    recipe: str
    compress: dict[str, Any] = field(default_factory=dict)


FAMILIES = {
    "mixtral": Family(tf.MixtralConfig, {"intermediate_size": 32, "num_local_experts": EXPERTS}, "rtn-w4"),
    "qwen2_moe": Family(  # a shared expert behind a sigmoid shared_expert_gate (a linear that stays unquantized)
        tf.Qwen2MoeConfig,
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": EXPERTS,
        },
        "w4-lut8",
        FISHER,
    ),
    "qwen3_moe": Family(
        tf.Qwen3MoeConfig,
        {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": EXPERTS, "head_dim": 16},
        "w4",
        FISHER,
    ),
    "deepseek_v3": Family(  # MLA attention (q_a/q_b, kv_a/kv_b), one dense layer, then shared + routed experts
        tf.DeepseekV3Config,
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "n_routed_experts": EXPERTS,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
            "num_key_value_heads": 4,
        },
        "w4",
        FISHER,
    ),
    "glm4_moe": Family(
        tf.Glm4MoeConfig,
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "n_routed_experts": EXPERTS,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 16,
        },
        "w4",
        UNIFORM,
    ),
    "gpt_oss": Family(  # transposed (E, in, out) experts with unquantized biases; sliding and full layers
        tf.GptOssConfig,
        {"intermediate_size": 32, "num_local_experts": EXPERTS, "head_dim": 16, "sliding_window": 4},
        "w4",
        FISHER,
    ),
}


@dataclass
class Built:
    """One family's artifact, the reference (original with dequantized weights) and what the artifact quantized."""

    name: str
    artifact: Path
    reference: nn.Module
    linears: list[str]
    experts: list[str]
    expected: set[str]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any, tiny_text_file: Path
) -> Built:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module scope runs before conftest's one-thread fixture: tiny ops, busy machine
    try:
        return _build(request.param, tmp_path_factory, tiny_tokenizer, tiny_text_file)
    finally:
        torch.set_num_threads(threads)


def _build(name: str, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any, tiny_text_file: Path) -> Built:
    family = FAMILIES[name]
    config = family.config(**{**DIMS, "vocab_size": len(tiny_tokenizer), **family.settings})
    torch.manual_seed(0)
    original = tf.AutoModelForCausalLM.from_config(config).eval()
    original.set_experts_implementation("eager")  # the loop the runtime runs (same routing, same sums)
    expected = {
        n for n, m in original.named_modules() if isinstance(m, nn.Linear) and n.rpartition(".")[2] in LINEAR_TARGETS
    }
    expected |= {n for n, p in original.named_parameters() if p.dim() == 3 and n.rpartition(".")[2] in EXPERT_TARGETS}
    root = tmp_path_factory.mktemp(name)
    compress_tiny_model(original, tiny_tokenizer, root, family.recipe, family.compress, tiny_text_file)
    loaded = api.load(root / "artifact").model
    linears = [n for n, m in loaded.named_modules() if isinstance(m, SqueezeLinear)]
    experts = [n for n, m in loaded.named_modules() if isinstance(m, SqueezeExperts)]
    for module_name in linears:  # the reference: the original model with the artifact's dequantized weights
        linear = original.get_submodule(module_name)
        assert isinstance(linear, nn.Linear)
        linear.weight.data = loaded.get_submodule(module_name).dequantize()
    for param_name in experts:
        param = original.get_parameter(param_name)
        weight = loaded.get_submodule(param_name).dequantize()  # (E, out, in) or (E, in, out), as the parameter
        assert weight.shape == param.shape
        param.data = weight
    return Built(name, root / "artifact", original, linears, experts, expected)


def _logits(model: nn.Module) -> torch.Tensor:
    return logits(model, IDS)


def test_every_target_and_expert_is_quantized_and_routers_are_not(built: Built) -> None:
    assert set(built.linears) | set(built.experts) == built.expected
    assert len(built.experts) == 2 * DIMS["num_hidden_layers"] - 2 * (built.name == "deepseek_v3")  # dense layer 0
    modules = json.loads((built.artifact / "config.json").read_text())["quantization_config"]["modules"]
    assert not [n for n in modules if n.endswith((".gate", ".router", "shared_expert_gate"))]
    for name in built.experts:
        assert modules[name]["experts"] == EXPERTS and modules[name]["transposed"] == (built.name == "gpt_oss")
    assert api.verify_model_integrity(built.artifact).ok
    result = runner.invoke(app, ["verify", str(built.artifact)])
    assert result.exit_code == 0, result.output


def test_runtime_logits_equal_the_dequantized_reference(built: Built) -> None:
    ours, reference = _logits(api.load(built.artifact, activations="float32").model), _logits(built.reference)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= ATOL


def test_from_pretrained_logits_equal_the_dequantized_reference(built: Built) -> None:
    import squeeze  # noqa: F401 - registers the quantizer with transformers

    model = tf.AutoModelForCausalLM.from_pretrained(built.artifact)
    set_activations(model, "float32")  # the exact path, compared with the dequantized reference
    assert [n for n, m in model.named_modules() if isinstance(m, SqueezeExperts)] == built.experts
    assert {n for n, m in model.named_modules() if isinstance(m, SqueezeLinear)} == set(built.linears)
    assert (_logits(model) - _logits(built.reference)).abs().max().item() <= ATOL


def test_one_forward_uses_only_the_routed_experts(built: Built) -> None:
    model = api.load(built.artifact).model
    routed: dict[str, set[int]] = {}

    def record(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            routed[name] = set(args[1].reshape(-1).tolist())  # (hidden_states, top-k expert indices, weights)

        return hook

    layers = {n.rpartition(".")[0] for n in built.experts}
    for name in layers:
        model.get_submodule(name).register_forward_pre_hook(record(name))
    with torch.no_grad():
        model(IDS[:, :2])  # 2 tokens x top-2: at most 4 experts per layer, usually fewer
    assert set(routed) == layers
    for name in built.experts:
        assert model.get_submodule(name).used == len(routed[name.rpartition(".")[0]])


def test_squeeze_run_continues_like_the_reference(built: Built, tiny_tokenizer: Any) -> None:
    check_squeeze_run(built.artifact, built.reference, tiny_tokenizer, PROMPT)


def test_squeeze_eval_equals_the_reference_perplexity(built: Built, tiny_tokenizer: Any, tiny_text_file: Path) -> None:
    check_squeeze_eval(built.artifact, built.reference, tiny_tokenizer, tiny_text_file, EVAL_SEQ_LEN, EVAL_WINDOWS)
