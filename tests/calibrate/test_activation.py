"""The activation sensitivity (squeeze.calibrate.activation): E[x_c^2] per input column, forwards only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from squeeze.calibrate.activation import activation_sensitivity, blockwise_activation_sensitivity
from squeeze.models.targets import find_target_linears


def _windows(tokenizer: Any, text: str, n: int = 3, seq_len: int = 24) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids[: n * seq_len].reshape(n, seq_len)


def _direct_moments(model: nn.Module, windows: torch.Tensor, linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Every input of every linear kept, then mean x^2 per column over all tokens at once (float64)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    handles = [
        m.register_forward_hook(lambda _m, args, _out, name=name: seen[name].append(args[0].detach()))
        for name, m in linears.items()
    ]
    try:
        with torch.no_grad():
            for row in windows:
                model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {
        name: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).double().pow(2).mean(0) for name, xs in seen.items()
    }


def test_weights_are_the_mean_square_of_each_input_column(tiny_llama: tuple[Any, Any], tiny_text: str) -> None:
    model, tokenizer = tiny_llama
    windows = _windows(tokenizer, tiny_text)
    linears = find_target_linears(model, ("q_proj", "o_proj", "down_proj", "gate_proj"), ("lm_head",))
    got = activation_sensitivity(model, windows, linears)
    want = _direct_moments(model, windows, linears)
    assert sorted(got) == sorted(linears)
    for name, linear in linears.items():
        weights = got[name]
        assert weights.dtype == torch.float32 and weights.shape == linear.weight.shape
        assert torch.equal(weights, weights[:1].expand_as(weights))  # one moment per column, on every row
        torch.testing.assert_close(weights[0].double(), want[name], rtol=1e-6, atol=0)
    # and independently of hooks: q_proj of block 0 reads input_layernorm(embedding)
    block = model.model.layers[0]
    with torch.no_grad():
        x = torch.cat([block.input_layernorm(model.model.embed_tokens(row)) for row in windows]).double()
    name = next(n for n in linears if n.endswith("layers.0.self_attn.q_proj"))
    torch.testing.assert_close(got[name][0].double(), x.pow(2).mean(0), rtol=1e-6, atol=0)


def test_block_by_block_gives_the_same_bits_and_embeddings_are_uniform(
    tiny_llama: tuple[Any, Any], tiny_text: str, tmp_path: Any
) -> None:
    model, tokenizer = tiny_llama
    windows = _windows(tokenizer, tiny_text)
    linears = find_target_linears(model, ("q_proj", "v_proj", "up_proj", "down_proj"), ("lm_head",))
    embeddings = {"model.embed_tokens": model.model.embed_tokens}
    whole = activation_sensitivity(model, windows, linears, embeddings)
    groups: list[dict[str, torch.Tensor]] = []
    spill = tmp_path / "spill"
    assert (
        blockwise_activation_sensitivity(model, windows, linears, embeddings, spill_dir=spill, on_group=groups.append)
        == {}
    )
    blockwise = {name: t for group in groups for name, t in group.items()}
    assert sorted(blockwise) == sorted(whole)
    for name in whole:
        assert torch.equal(blockwise[name], whole[name]), name
    assert torch.equal(whole["model.embed_tokens"], torch.ones(model.model.embed_tokens.weight.shape))
    assert len(groups) == 1 + len(model.model.layers)  # the embedding, then one group per block
    assert not list(spill.glob("*.safetensors"))  # every spilled boundary read once and removed


def test_an_untied_lm_head_target_reads_the_normed_last_hidden_state(
    tiny_llama: tuple[Any, Any], tiny_text: str
) -> None:
    model, tokenizer = tiny_llama
    windows = _windows(tokenizer, tiny_text, n=2)
    targets = {"lm_head": model.lm_head, "model.layers.1.mlp.down_proj": model.model.layers[1].mlp.down_proj}
    whole = activation_sensitivity(model, windows, targets)
    blockwise = blockwise_activation_sensitivity(model, windows, targets)
    assert all(torch.equal(blockwise[name], whole[name]) for name in targets)
    with torch.no_grad():
        hidden = torch.cat(
            [model(input_ids=row[None], output_hidden_states=True).hidden_states[-1][0] for row in windows]
        )
    torch.testing.assert_close(whole["lm_head"][0].double(), hidden.double().pow(2).mean(0), rtol=1e-6, atol=0)
