"""MoE expert parameters: discovery per family (tiny random models built from transformers configs, never
run), the (E*out, in) matrix view against a per-expert reference, the unrouted count, and MLA refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

from squeeze.config import DEFAULT_TARGETS
from squeeze.errors import ModelError
from squeeze.models.expert_params import (
    ExpertWeight,
    expert_modules,
    expert_parameters,
    stack_experts,
    unrouted_experts,
    unrouted_message,
    unstack_experts,
)
from squeeze.models.targets import (
    attention_modules,
    find_target_linears,
    find_targets,
    linear_targets,
    matrix_fisher,
    target_at,
    target_matrix,
    target_shape,
)

H, I_MOE, E = 64, 32, 4
DIMS = {
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
#: family -> (config class, settings, expected (E, ., .) shapes of gate_up_proj / down_proj, transposed,
#: the layers with routed experts, extra linear leaves that must be targets)
FAMILIES: dict[str, tuple[Any, dict[str, Any], tuple[int, ...], tuple[int, ...], bool, list[int], set[str]]] = {
    "mixtral": (
        tf.MixtralConfig,
        {"num_local_experts": E, "num_experts_per_tok": 2},
        (E, 2 * 96, H),
        (E, H, 96),
        False,
        [0, 1],
        set(),
    ),
    "qwen2_moe": (
        tf.Qwen2MoeConfig,
        {
            "num_experts": E,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": I_MOE,
            "shared_expert_intermediate_size": 48,
        },
        (E, 2 * I_MOE, H),
        (E, H, I_MOE),
        False,
        [0, 1],
        {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"},
    ),
    "qwen3_moe": (
        tf.Qwen3MoeConfig,
        {"num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I_MOE, "head_dim": 16},
        (E, 2 * I_MOE, H),
        (E, H, I_MOE),
        False,
        [0, 1],
        set(),
    ),
    "deepseek_v3": (
        tf.DeepseekV3Config,
        {
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": I_MOE,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
        (E, 2 * I_MOE, H),
        (E, H, I_MOE),
        False,
        [1],  # layer 0 is dense (first_k_dense_replace)
        {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "shared_experts.gate_proj", "mlp.gate_proj"},
    ),
    "glm4_moe": (
        tf.Glm4MoeConfig,
        {
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": I_MOE,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
        (E, 2 * I_MOE, H),
        (E, H, I_MOE),
        False,
        [1],
        {"shared_experts.down_proj", "mlp.down_proj"},
    ),
    "gpt_oss": (
        tf.GptOssConfig,
        {
            "num_local_experts": E,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 4,
        },
        (E, H, 2 * 96),  # (E, in, out): transposed
        (E, 96, H),
        True,
        [0, 1],
        set(),
    ),
}


def build(family: str) -> nn.Module:
    config_class, settings, *_ = FAMILIES[family]
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config_class(**{**DIMS, **settings})).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, build(request.param)


def test_default_targets_find_every_expert_parameter_and_no_router(family: tuple[str, nn.Module]) -> None:
    name, model = family
    _cls, _settings, gate_up, down, transposed, layers, extra = FAMILIES[name]
    found = find_targets(model, DEFAULT_TARGETS, ["lm_head"])
    experts = {n: t for n, t in found.items() if isinstance(t, ExpertWeight)}
    assert sorted(experts) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in ("gate_up_proj", "down_proj")
    )
    for n, t in experts.items():
        shape = gate_up if n.endswith("gate_up_proj") else down
        assert tuple(t.weight.shape) == shape and t.transposed is transposed and t.experts == E
        assert t.weight is model.get_parameter(n)  # the parameter itself: Fisher hooks see its gradient
        out, cols = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
        assert target_shape(t) == t.matrix_shape == (E * out, cols)
        assert target_at(model, n).weight is t.weight  # found again by name (the load stage)
    # routers and gates stay in full precision; biases are never expert projections
    assert not [n for n in found if n.endswith((".gate", ".router", "shared_expert_gate")) or "bias" in n]
    missing = [e for e in extra if not any(n.endswith("." + e) for n in found)]  # shared experts, dense MLPs, MLA
    assert not missing, sorted(found)
    # the linear-only finder is unchanged: no expert parameter
    assert not set(find_target_linears(model, DEFAULT_TARGETS, ["lm_head"])) & set(experts)
    assert set(linear_targets(found)) == set(found) - set(experts)


def test_targets_ignore_and_suffixes_apply_to_expert_parameters() -> None:
    model = build("qwen3_moe")
    only_down = find_targets(model, ["down_proj"])
    assert sorted(only_down) == ["model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj"]
    assert list(find_targets(model, ["experts.gate_up_proj"], ["layers.0."])) == [
        "model.layers.1.mlp.experts.gate_up_proj"
    ]
    with pytest.raises(ModelError, match=r"no nn.Linear in .*expert parameters seen: .*gate_up_proj"):
        find_targets(model, ["nothing_here"])
    with pytest.raises(ModelError, match="plain string"):
        find_targets(model, "down_proj")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="neither"):
        target_at(model, "model.layers.0.mlp.gate")


def test_an_undecorated_3d_parameter_is_not_a_target() -> None:
    class Plain(nn.Module):  # no use_experts_implementation: its layout cannot be known
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 3))
            self.down_proj = nn.Linear(3, 3)

    model = nn.Sequential(Plain())
    assert list(find_targets(model, ["gate_up_proj", "down_proj"])) == ["0.down_proj"]
    assert list(expert_parameters(model)) == []


@pytest.mark.parametrize("transposed", [False, True])
def test_the_stacked_matrix_rows_are_each_experts_output_rows(transposed: bool) -> None:
    experts, out, cols = 3, 5, 7
    per_expert = torch.randn(experts, out, cols)  # expert e's (out, in) matrix, as nn.Linear would hold it
    param = per_expert.transpose(1, 2).contiguous() if transposed else per_expert.clone()
    stacked = stack_experts(param, transposed)
    assert stacked.shape == (experts * out, cols)
    for e in range(experts):
        assert torch.equal(stacked[e * out : (e + 1) * out], per_expert[e])
    assert torch.equal(unstack_experts(stacked, experts, transposed), param)
    # the golden layout on small integers: rows e*out.. are expert e's rows
    golden = torch.arange(2 * 2 * 3).reshape(2, 2, 3)
    assert stack_experts(golden, False).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert stack_experts(golden.transpose(1, 2).contiguous(), True).tolist() == stack_experts(golden, False).tolist()


def test_a_real_experts_module_stacks_its_parameter_and_fisher_alike() -> None:
    model = build("gpt_oss")
    name = "model.layers.1.mlp.experts.down_proj"
    target = find_targets(model, ["down_proj"])[name]
    assert isinstance(target, ExpertWeight)
    param = target.weight.detach()
    matrix = target_matrix(target)
    for e in range(E):  # gpt-oss computes x @ down_proj[e]: expert e's linear weight is down_proj[e].T
        assert torch.equal(matrix[e * H : (e + 1) * H], param[e].T)
    fisher = torch.rand_like(param)
    assert torch.equal(matrix_fisher(target, fisher), stack_experts(fisher, True))
    with pytest.raises(ValueError, match="expected a tensor of shape"):
        target.stack(torch.zeros(2, 2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: stack_experts(torch.zeros(4, 4), False), "3-D expert parameter"),
        (lambda: unstack_experts(torch.zeros(10, 4), 3, False), "cannot split"),
        (lambda: unstack_experts(torch.zeros(10, 4), 0, False), "cannot split"),
    ],
)
def test_bad_shapes_are_refused(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_unrouted_experts_are_those_with_an_all_zero_fisher() -> None:
    model = build("qwen3_moe")
    targets = find_targets(model, DEFAULT_TARGETS)
    fisher = {name: torch.rand_like(t.weight) + 0.1 for name, t in targets.items()}
    fisher["model.layers.1.mlp.experts.gate_up_proj"][2] = 0
    assert unrouted_experts(fisher, targets) == ({}, 2 * E)  # down_proj of expert 2 still has a gradient
    fisher["model.layers.1.mlp.experts.down_proj"][2] = 0
    fisher["model.layers.0.mlp.experts.down_proj"][0] = 0  # one parameter only: reached
    found, total = unrouted_experts(fisher, targets)
    assert found == {"model.layers.1.mlp.experts": [2]} and total == 2 * E
    assert sorted(expert_modules(targets)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    message = unrouted_message(found, total)
    assert "1 of 8 experts" in message and "model.layers.1.mlp.experts [2]" in message and "calibration" in message


def test_calibrate_kv_refuses_mla_attention_with_a_clear_error() -> None:
    with pytest.raises(ModelError, match=r"multi-head latent attention .*DeepseekV3ForCausalLM") as info:
        attention_modules(build("deepseek_v3"))
    assert "unquantized" in (info.value.hint or "")
    assert len(attention_modules(build("qwen3_moe"))) == 2  # an ordinary MoE's attention is supported
