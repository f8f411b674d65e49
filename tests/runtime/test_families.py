"""Every dense decoder family goes through the one loader: compress -> verify -> run -> eval -> from_pretrained.

Tiny random models are built from each family's transformers config class (no downloads, 2 layers, hidden
64) and saved with the in-memory tokenizer of conftest.py. The logits of squeeze.load's model and of
``AutoModelForCausalLM.from_pretrained(artifact)`` must equal, within 1e-4, those of the reference: the
original model with each quantized linear's weight replaced by the artifact's dequantized weight. So every
tensor the artifact keeps as is (embeddings, norms, an untied head), every buffer the loader rebuilds
(rotary tables per rope type, Gemma's embedding scale) and every config switch (sliding windows,
soft-capping, q/k norms, fused projections) must survive the round trip.
"""

from __future__ import annotations

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
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.weight_paths import set_activations

runner = CliRunner()
ATOL = 1e-4
SLIDING = 4  # shorter than the prompts below, so sliding-window layers really drop keys
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 300, 12, 2, 45, 200]])  # 16 tokens
PROMPT = "Once upon a time there was a little"
EVAL_SEQ_LEN, EVAL_WINDOWS = 16, 3
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
FISHER = {"calibration_overrides": {"num_samples": 2, "seq_len": 32}}  # Fisher from 2 windows of 32 tokens


@dataclass(frozen=True)
class Family:
    """A family's config class and settings, and the recipe (with api.compress keywords) it is compressed with."""

    config: type
    settings: dict[str, Any]
    recipe: str
    compress: dict[str, Any] = field(default_factory=dict)


FAMILIES = {
    "llama": Family(tf.LlamaConfig, {}, "rtn-w4"),
    "mistral": Family(tf.MistralConfig, {"sliding_window": SLIDING}, "w4-lut8", FISHER),
    "qwen2": Family(tf.Qwen2Config, {}, "w4", FISHER),  # q/k/v biases
    "qwen3": Family(tf.Qwen3Config, {"head_dim": 16}, "w3-s045", {"overrides": {"weights.sensitivity": "uniform"}}),
    "gemma2": Family(tf.Gemma2Config, {"head_dim": 16, "sliding_window": SLIDING}, "w4-lut8", FISHER),
    "gemma3": Family(
        tf.Gemma3TextConfig,
        {  # scaled embeddings, one local and one global layer, two rope tables
            "head_dim": 16,
            "sliding_window": SLIDING,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        "w4",
        FISHER,
    ),
    "phi3": Family(
        tf.Phi3Config,
        {},
        "rtn-w4",
        {
            "overrides": {  # fused qkv_proj and gate_up_proj
                "weights.targets": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                "weights.group_size": 32,
            }
        },
    ),
    "smollm": Family(tf.LlamaConfig, {"tie_word_embeddings": True}, "w4-lut8", FISHER),  # tied embeddings
}


@dataclass
class Built:
    """One family's original model, its artifact and the reference (original with dequantized weights)."""

    name: str
    artifact: Path
    reference: nn.Module
    quantized: list[str]


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
    root = tmp_path_factory.mktemp(name)
    compress_tiny_model(original, tiny_tokenizer, root, family.recipe, family.compress, tiny_text_file)
    loaded = api.load(root / "artifact")
    quantized = [n for n, m in loaded.model.named_modules() if isinstance(m, SqueezeLinear)]
    for module_name in quantized:  # the reference: the original model with the artifact's dequantized weights
        linear = original.get_submodule(module_name)
        assert isinstance(linear, nn.Linear)
        linear.weight.data = loaded.model.get_submodule(module_name).dequantize()
    return Built(name, root / "artifact", original, quantized)


def _logits(model: nn.Module) -> torch.Tensor:
    return logits(model, IDS)


def test_the_artifact_is_quantized_and_intact(built: Built) -> None:
    expected = {"phi3": 4}.get(built.name, 7) * DIMS["num_hidden_layers"]
    assert len(built.quantized) == expected
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
    assert {n for n, m in model.named_modules() if isinstance(m, SqueezeLinear)} == set(built.quantized)
    assert (_logits(model) - _logits(built.reference)).abs().max().item() <= ATOL


def test_squeeze_run_continues_like_the_reference(built: Built, tiny_tokenizer: Any) -> None:
    assert tiny_tokenizer(PROMPT, return_tensors="pt")["input_ids"].shape[1] > SLIDING  # sliding layers drop keys
    check_squeeze_run(built.artifact, built.reference, tiny_tokenizer, PROMPT)


def test_squeeze_eval_equals_the_reference_perplexity(built: Built, tiny_tokenizer: Any, tiny_text_file: Path) -> None:
    check_squeeze_eval(built.artifact, built.reference, tiny_tokenizer, tiny_text_file, EVAL_SEQ_LEN, EVAL_WINDOWS)
