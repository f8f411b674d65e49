"""find_target_linears: suffix matching on dotted boundaries, ignore substrings, model order, errors."""

from __future__ import annotations

import pytest
from torch import nn

from squeeze.config import DEFAULT_TARGETS
from squeeze.errors import ModelError
from squeeze.models import find_target_linears


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.xq_proj = nn.Linear(4, 4)  # must not match "q_proj": not on a dotted boundary
        self.block = nn.ModuleDict({"q_proj": nn.Linear(4, 4), "q_proj_norm": nn.LayerNorm(4)})
        self.lm_head = nn.Linear(4, 8)


def test_dotted_boundary_and_order() -> None:
    toy = _Toy()
    found = find_target_linears(toy, ["q_proj"], [])
    assert list(found) == ["q_proj", "block.q_proj"]
    assert found["block.q_proj"] is toy.block["q_proj"]


def test_dotted_suffix_target() -> None:
    assert list(find_target_linears(_Toy(), ["block.q_proj"], [])) == ["block.q_proj"]


def test_tiny_llama_default_targets(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    found = find_target_linears(model, DEFAULT_TARGETS, ["lm_head"])
    assert len(found) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    names = list(found)
    assert names[:7] == [
        f"model.layers.0.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    state = model.state_dict()
    for name, module in found.items():
        assert isinstance(module, nn.Linear)
        assert state[f"{name}.weight"].data_ptr() == module.weight.data_ptr()  # names are state-dict prefixes
    assert found["model.layers.0.mlp.down_proj"].weight.shape == (64, 144)


def test_ignore_is_a_substring(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    found = find_target_linears(model, ["down_proj"], ["layers.0.", "layers.4."])
    assert list(found) == ["model.layers.1.mlp.down_proj"]
    found = find_target_linears(model, ["o_proj", "down_proj"], ["ml"])  # a plain substring, no dotted boundary
    assert list(found) == [f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)]


def test_lm_head_only_when_not_ignored(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    assert list(find_target_linears(model, ["lm_head"], [])) == ["lm_head"]
    with pytest.raises(ModelError):
        find_target_linears(model, ["lm_head"], ["lm_head"])


def test_no_match_names_architecture_and_linears(tiny_llama: tuple) -> None:
    model, _ = tiny_llama
    with pytest.raises(ModelError) as info:
        find_target_linears(model, ["nonexistent"], ["lm_head"])
    message = info.value.message
    assert "LlamaForCausalLM" in message and "'nonexistent'" in message
    assert "q_proj" in message and "down_proj" in message  # what the user could have typed
    assert info.value.hint and "weights.targets" in info.value.hint


def test_no_match_without_config_uses_class_name() -> None:
    with pytest.raises(ModelError, match="_Toy"):
        find_target_linears(_Toy(), ["nonexistent"], [])


def test_plain_string_targets_rejected() -> None:
    with pytest.raises(ModelError, match="plain string"):
        find_target_linears(_Toy(), "q_proj", [])  # type: ignore[arg-type]
