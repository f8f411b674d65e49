"""materialise_computed_buffers: a meta-device skeleton's non-persistent buffers, rebuilt with no per-class code.

The loader used to call ``type(module)(config=model.config)`` for each module holding a meta buffer: Gemma's
scaled embedding (constructor ``(num_embeddings, embedding_dim, padding_idx, embed_scale)``) failed that,
and a module built from a config other than the model's would have been rebuilt wrongly.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import squeeze.runtime.buffers as buffers
from squeeze.errors import FormatError
from squeeze.runtime.buffers import buffer_skeleton, materialise_computed_buffers, meta_buffer_bytes

DIMS = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}

# config class, extra settings: rope types whose tables depend on more than the head size, and Gemma's buffers
CONFIGS = {
    "llama-default": (tf.LlamaConfig, {}),
    "llama3-rope": (
        tf.LlamaConfig,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            }
        },
    ),
    "qwen2-yarn": (
        tf.Qwen2Config,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "phi3-longrope": (
        tf.Phi3Config,
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [3.0] * 4,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "gemma2": (tf.Gemma2Config, {"head_dim": 8, "sliding_window": 4}),
    "gemma3-two-ropes": (
        tf.Gemma3TextConfig,
        {
            "head_dim": 8,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
}


def _reference_and_skeleton(kind: str) -> tuple[nn.Module, nn.Module]:
    """A model built normally on CPU, and the same architecture on meta holding its state dict (as the loader does)."""
    config_class, extra = CONFIGS[kind]
    config = config_class(**{**DIMS, **extra})
    torch.manual_seed(0)
    reference = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.device("meta"):
        skeleton = tf.AutoModelForCausalLM.from_config(config).eval()
    skeleton.load_state_dict(reference.state_dict(), assign=True)
    if config.tie_word_embeddings:
        skeleton.tie_weights()
    return reference, skeleton


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_rebuilt_buffers_equal_those_of_a_model_built_on_cpu(kind: str) -> None:
    reference, skeleton = _reference_and_skeleton(kind)
    meta = {n for n, b in skeleton.named_buffers() if b.is_meta}
    assert meta and meta == {n for n, _ in reference.named_buffers()}  # every buffer is computed, none loaded
    materialise_computed_buffers(skeleton, limit=2**20)
    ours, theirs = dict(skeleton.named_buffers()), dict(reference.named_buffers())
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].device.type == "cpu", name
        assert torch.equal(ours[name], value), name
    for module_name, module in skeleton.named_modules():  # still non-persistent: not in the state dict
        assert module._non_persistent_buffers_set == reference.get_submodule(module_name)._non_persistent_buffers_set
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37]])
    with torch.no_grad():
        assert torch.equal(skeleton(ids).logits, reference(ids).logits)


def test_gemma3_has_what_the_per_class_rebuild_could_not_handle() -> None:
    _, skeleton = _reference_and_skeleton("gemma3-two-ropes")
    embed = skeleton.get_submodule("model.embed_tokens")
    with pytest.raises(TypeError):
        type(embed)(config=skeleton.config)  # the old per-module rebuild: not every module takes a config
    materialise_computed_buffers(skeleton, limit=2**20)
    assert embed.embed_scale.item() == pytest.approx(DIMS["hidden_size"] ** 0.5)  # scaled embeddings
    rotary = skeleton.get_submodule("model.rotary_emb")
    assert not torch.equal(rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq)


def test_too_many_bytes_are_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    _, skeleton = _reference_and_skeleton("gemma3-two-ropes")
    size = meta_buffer_bytes(skeleton)
    assert size == 4 + 4 * 4 * 4  # embed_scale, and 4 tables of head_dim / 2 float32 each

    def refuse(model: nn.Module) -> nn.Module:
        pytest.fail("a skeleton was built although the buffers exceed the limit")

    monkeypatch.setattr(buffers, "buffer_skeleton", refuse)
    with pytest.raises(FormatError, match=f"asks for {size} bytes of computed buffers, more than the {size - 1}"):
        materialise_computed_buffers(skeleton, limit=size - 1)
    monkeypatch.undo()
    materialise_computed_buffers(skeleton, limit=size)  # exactly at the limit is allowed
    assert meta_buffer_bytes(skeleton) == 0


def test_nothing_on_meta_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, _ = _reference_and_skeleton("llama-default")
    before = {n: b.data_ptr() for n, b in reference.named_buffers()}
    monkeypatch.setattr(buffers, "buffer_skeleton", lambda model: pytest.fail("built a skeleton for nothing"))
    materialise_computed_buffers(reference, limit=0)
    assert {n: b.data_ptr() for n, b in reference.named_buffers()} == before  # loaded buffers are left alone


def test_persistent_buffers_and_parameters_left_on_meta_are_a_format_error() -> None:
    _, skeleton = _reference_and_skeleton("llama-default")
    norm = skeleton.get_submodule("model.norm")
    norm.register_buffer("running", torch.empty(4, device="meta"))  # persistent: it belongs in the artifact
    with pytest.raises(FormatError, match=r"artifact lacks tensors the architecture needs: \['model.norm.running'\]"):
        materialise_computed_buffers(skeleton, limit=2**20)
    _, skeleton = _reference_and_skeleton("llama-default")
    skeleton.get_submodule("model.norm").weight = nn.Parameter(torch.empty(32, device="meta"))
    with pytest.raises(FormatError, match="model.norm.weight"):
        materialise_computed_buffers(skeleton, limit=2**20)


def test_the_skeleton_allocates_buffers_only_and_leaves_the_config_alone() -> None:
    reference, skeleton = _reference_and_skeleton("gemma2")
    config_before = skeleton.config.to_dict()
    built = buffer_skeleton(skeleton)
    assert all(p.is_meta for p in built.parameters())
    assert not any(b.is_meta for b in built.buffers())
    assert skeleton.config.to_dict() == config_before
    plain = nn.Linear(2, 2)  # the register_parameter patch is gone once the skeleton is built
    assert not plain.weight.is_meta


def test_a_model_without_a_config_is_an_internal_error() -> None:
    module = nn.Module()
    module.register_buffer("table", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(TypeError, match="has no config"):
        materialise_computed_buffers(module, limit=100)
