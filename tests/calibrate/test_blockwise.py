"""The block-by-block Fisher (--max-memory) equals fisher_information on the whole model, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze.calibrate.blockwise import blockwise_fisher
from squeeze.calibrate.fisher import fisher_information
from squeeze.errors import ConfigError
from squeeze.models import resolve_model
from squeeze.models.lazy import LazyModel
from squeeze.models.targets import find_target_linears


def _windows(vocab: int, n: int = 3, seq_len: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))


def _reference(model: Any, windows: torch.Tensor, modules: dict[str, Any]) -> dict[str, torch.Tensor]:
    return fisher_information(model, windows, modules)


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name
        assert want[name].abs().sum() > 0, name  # a gradient reached it: equality of zeros would prove nothing


def test_resident_model_matches_whole_model(tiny_llama: tuple[Any, Any], tmp_path: Path) -> None:
    model, _ = tiny_llama
    targets = find_target_linears(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    windows = _windows(model.config.vocab_size)
    want = _reference(model, windows, targets)
    _assert_identical(blockwise_fisher(model, windows, targets), want)
    groups: list[list[str]] = []
    spilled: dict[str, torch.Tensor] = {}

    def sink(part: dict[str, torch.Tensor]) -> None:
        groups.append(sorted(part))
        spilled.update(part)

    assert blockwise_fisher(model, windows, targets, spill_dir=tmp_path / "spill", on_group=sink) == {}
    _assert_identical(spilled, want)
    assert [g[0].split(".")[2] for g in groups] == ["1", "0"]  # from the end backwards, one group per block
    assert list((tmp_path / "spill").iterdir()) == []  # every spilled file read back and removed


def test_lazy_model_matches_loaded_model(tiny_llama_dir: Path, tiny_llama: tuple[Any, Any]) -> None:
    model, _ = tiny_llama
    lazy = LazyModel(resolve_model(str(tiny_llama_dir)))
    names = list(find_target_linears(model, ["q_proj", "down_proj"]))
    windows = _windows(model.config.vocab_size, n=2)
    want = _reference(model, windows, {n: model.get_submodule(n) for n in names})
    got = blockwise_fisher(
        lazy.model, windows, {n: lazy.model.get_submodule(n) for n in names}, materialized=lazy.materialized
    )
    _assert_identical(got, want)
    assert all(p.is_meta for p in lazy.model.parameters())  # every block went back to the meta device


def _small_llama(tied: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_embeddings_match(tied: bool) -> None:
    """A quantized input embedding (and an untied LM head) get their Fisher too; a tied weight sums the
    embedding's and the head's gradients before squaring, as autograd does on the whole model."""
    model = _small_llama(tied)
    modules: dict[str, Any] = {
        "model.embed_tokens": model.model.embed_tokens,
        "model.layers.1.mlp.up_proj": model.model.layers[1].mlp.up_proj,
    }
    if not tied:
        modules["lm_head"] = model.lm_head
    windows = _windows(96)
    _assert_identical(blockwise_fisher(model, windows, modules), _reference(model, windows, modules))


def test_stories260k_matches(stories: tuple[Any, Any]) -> None:
    model, _ = stories
    targets = find_target_linears(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    windows = _windows(model.config.vocab_size, n=2, seq_len=64)
    _assert_identical(blockwise_fisher(model, windows, targets), _reference(model, windows, targets))


def test_target_outside_blocks_refused() -> None:
    model = _small_llama(False)
    with pytest.raises(ConfigError, match="in no decoder block"):
        blockwise_fisher(model, _windows(96), {"x": torch.nn.Linear(2, 2)})


def test_gguf_source_refused(tmp_path: Path) -> None:
    from squeeze.models.source import ModelSource

    with pytest.raises(ConfigError, match="GGUF") as info:
        LazyModel(ModelSource(kind="gguf", path=tmp_path / "m.gguf", model_id="m"))
    assert "save_pretrained" in (info.value.hint or "")


def _tiny_moe(family: str) -> Any:
    """A tiny random Qwen3-MoE or gpt-oss (4 experts, hidden 64, 2 layers) or Mixtral (6 experts, top-3): its
    experts are 3-D parameters."""
    import transformers as tf

    dims = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    dims |= {"num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 96, "head_dim": 16}
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**dims, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif family == "mixtral":
        dims.pop("head_dim")
        config = tf.MixtralConfig(**dims, num_local_experts=6, num_experts_per_tok=3)
    else:
        layers = ["sliding_attention", "full_attention"]
        config = tf.GptOssConfig(
            **dims, num_local_experts=4, num_experts_per_tok=2, layer_types=layers, sliding_window=4
        )
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_parameters_match(family: str, tmp_path: Path) -> None:
    """MoE expert parameters (3-D, the gradient routed through the router) get the whole model's Fisher bit for
    bit, resident and read lazily from the checkpoint (Qwen3-MoE's saved one tensor per expert, fused on read)."""
    from squeeze.models.expert_params import ExpertWeight
    from squeeze.models.targets import find_targets, target_at

    model = _tiny_moe(family)
    targets: dict[str, Any] = dict(find_targets(model, ["q_proj", "down_proj", "gate_up_proj"], []))
    assert sum(isinstance(t, ExpertWeight) for t in targets.values()) == 4
    windows = _windows(96, n=2)
    want = _reference(model, windows, targets)
    _assert_identical(blockwise_fisher(model, windows, targets), want)
    model.save_pretrained(tmp_path)
    lazy = LazyModel(resolve_model(str(tmp_path)))
    lazy_targets = {name: target_at(lazy.model, name) for name in targets}
    got = blockwise_fisher(lazy.model, windows, lazy_targets, materialized=lazy.materialized)
    _assert_identical(got, want)
    assert all(p.is_meta for p in lazy.model.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lazy_model_reads_experts_saved_one_tensor_per_expert(family: str, tmp_path: Path) -> None:
    """transformers saves Qwen3-MoE's and Mixtral's experts one 2-D tensor per expert (Mixtral under
    ``block_sparse_moe``); LazyModel fuses them as from_pretrained does: every parameter equal to the loaded one."""
    import transformers as tf

    if family == "mixtral":
        dims = {"hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4}
        torch.manual_seed(0)
        config = tf.MixtralConfig(**dims, num_key_value_heads=2, vocab_size=96, num_local_experts=4)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    else:
        _tiny_moe(family).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert not any(key.endswith("experts.gate_up_proj") for key in handle.keys())  # noqa: SIM118
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    lazy = LazyModel(resolve_model(str(tmp_path)))
    state = [name for name, buffer in lazy.state() if buffer is None]
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    for name in state:
        assert torch.equal(lazy.read_state(name), loaded.get_parameter(name)), name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("size", [2, 3])
def test_experts_streamed_in_groups_match_the_whole_block(family: str, size: int, tmp_path: Path) -> None:
    """A MoE block's routed experts streamed a group at a time (attention and router resident, each group's
    gradient taken with the others' outputs constant) give the whole model's Fisher bit for bit: resident (views
    of the fused parameters) and lazily read (only the group's rows read from the checkpoint, spilled)."""
    from squeeze.calibrate.expert_streaming import ExpertStreaming
    from squeeze.models.targets import find_targets, target_at

    model = _tiny_moe(family)
    targets: dict[str, Any] = dict(find_targets(model, ["q_proj", "down_proj", "gate_up_proj"], []))
    windows = _windows(96, n=2)
    want = _reference(model, windows, targets)
    _assert_identical(blockwise_fisher(model, windows, targets, experts=ExpertStreaming(size)), want)
    cpu = torch.device("cpu")  # the --device path (each step placed; a group's slices moved with their module)
    _assert_identical(blockwise_fisher(model, windows, targets, experts=ExpertStreaming(size), device=cpu), want)
    model.save_pretrained(tmp_path)
    lazy = LazyModel(resolve_model(str(tmp_path)))
    lazy_targets = {name: target_at(lazy.model, name) for name in targets}
    streaming = ExpertStreaming(size, lazy.experts_slice)
    spill = tmp_path / "spill"
    got = blockwise_fisher(
        lazy.model, windows, lazy_targets, materialized=lazy.materialized, experts=streaming, spill_dir=spill
    )
    _assert_identical(got, want)
    assert all(p.is_meta for p in lazy.model.parameters())
    assert list(spill.iterdir()) == []  # every per-window experts tensor read back and removed


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_activation_pass_with_experts_in_groups_matches(family: str) -> None:
    """The forward-only sensitivity sees the same hidden states with the experts run a group at a time."""
    from squeeze.calibrate.activation import activation_sensitivity, blockwise_activation_sensitivity
    from squeeze.calibrate.expert_streaming import ExpertStreaming
    from squeeze.models.targets import find_targets

    model = _tiny_moe(family)
    targets: dict[str, Any] = dict(find_targets(model, ["q_proj", "o_proj", "down_proj", "gate_up_proj"], []))
    windows = _windows(96, n=2)
    want = activation_sensitivity(model, windows, targets)
    got = blockwise_activation_sensitivity(model, windows, targets, experts=ExpertStreaming(2))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_expert_groups_are_balanced_and_never_single() -> None:
    """Groups of at most ``size`` experts, nearly equal, none of one expert (transformers' expert-parallel path
    miscounts a rank holding one expert), and a size below 2 is refused."""
    from squeeze.calibrate.expert_streaming import ExpertStreaming, group_bounds

    assert group_bounds(4, 3) == [(0, 2), (2, 4)]
    assert group_bounds(384, 100) == [(0, 96), (96, 192), (192, 288), (288, 384)]
    assert group_bounds(3, 2) == [(0, 3)]
    assert group_bounds(16, 16) == [(0, 16)]
    with pytest.raises(ValueError, match="at least 2"):
        ExpertStreaming(1)


def test_expert_groups_combine_window_shares_in_rank_order() -> None:
    """Under torchrun each rank streams the same expert groups over its share of the windows; ``combine`` gets
    every group's float64 sums (the experts' per group, then the block's resident ones) in the same order on
    every rank, so adding rank 1's to rank 0's there gives the one-process bits."""
    from squeeze.calibrate.expert_streaming import ExpertStreaming
    from squeeze.models.targets import find_targets

    model = _tiny_moe("qwen3_moe")
    targets: dict[str, Any] = dict(find_targets(model, ["q_proj", "down_proj", "gate_up_proj"], []))
    windows = _windows(96, n=3)
    want = _reference(model, windows, targets)
    shares: list[dict[str, torch.Tensor]] = []
    blockwise_fisher(model, windows[1:], targets, experts=ExpertStreaming(2), combine=lambda s: shares.append(dict(s)))
    calls = iter(shares)

    def add_rank_1(sums: dict[str, torch.Tensor]) -> None:
        other = next(calls)
        assert sorted(other) == sorted(sums)
        for name in sums:
            sums[name] += other[name]

    got = blockwise_fisher(model, windows[:1], targets, experts=ExpertStreaming(2), combine=add_rank_1)
    assert next(calls, None) is None  # as many combine calls on both ranks
    _assert_identical(got, want)
