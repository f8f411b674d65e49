"""Prefill + decode (squeeze.runtime.decode) give exactly the tokens of transformers' ``model.generate``.

A tiny random Llama and GPT-2 built here (no files) and, when ../shared is present, stories260K: greedy and seeded
sampling over a left-padded batch, end-of-sequence handling, the quantized KV cache, and the forward count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from squeeze.models.modes import cache_kwarg
from squeeze.runtime.decode import DecodeOptions, decode, prefill
from squeeze.runtime.generate import generate
from squeeze.runtime.kv_selection import kv_spec_for
from squeeze.runtime.quantized_cache import SqueezeKVCache
from squeeze.runtime.sampling_params import SamplingParams

PAD = 0


def _tiny(kind: str) -> torch.nn.Module:
    """A random Llama (rotary positions) or GPT-2 (absolute positions: a wrong position id changes its output)."""
    torch.manual_seed(0)
    if kind == "llama":
        net = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=97,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                bos_token_id=1,
                eos_token_id=None,
                pad_token_id=PAD,
            )
        )
    else:
        # untied: scaling a tied head would scale the input embeddings too
        net = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=97,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                tie_word_embeddings=False,
                bos_token_id=1,
                eos_token_id=None,
                pad_token_id=PAD,
            )
        )
    with torch.no_grad():  # larger logits than the init's: greedy and sampled tokens then vary along a row
        net.get_output_embeddings().weight.mul_(40)
    return net.eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return _tiny(request.param)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return _tiny("llama")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by 3: (2, 7) int64 ids and mask."""
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25], [PAD, PAD, PAD, 1, 40, 41, 42]])
    return ids, (ids != PAD).long()


def _ours(model, options: DecodeOptions, cache=None, seed: int | None = None) -> torch.Tensor:
    ids, mask = _batch()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        state = prefill(model, ids, mask, cache if cache is not None else DynamicCache(config=model.config))
        return decode(model, state, options)


def _theirs(model, max_new_tokens: int, cache=None, seed: int | None = None, **kwargs) -> torch.Tensor:
    ids, mask = _batch()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=PAD,
            **{cache_kwarg(model): cache if cache is not None else DynamicCache(config=model.config)},
            **kwargs,
        )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17])
def test_greedy_decode_equals_generate(model, max_new_tokens: int) -> None:
    ours = _ours(model, DecodeOptions(SamplingParams(max_tokens=max_new_tokens), pad_id=PAD))
    assert ours.shape == (2, max_new_tokens) and ours.dtype == torch.int64
    assert torch.equal(ours, _theirs(model, max_new_tokens, do_sample=False))
    assert max_new_tokens < 3 or len(set(ours[0].tolist())) > 1  # not a degenerate repeat of one token


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (1.0, 0.97)])
def test_seeded_sampling_equals_generate(model, temperature: float, top_p: float) -> None:
    options = DecodeOptions(SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p), pad_id=PAD)
    for seed in (0, 3):
        ours = _ours(model, options, seed=seed)
        theirs = _theirs(model, 12, seed=seed, do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        assert torch.equal(ours, theirs), (seed, ours, theirs)
    assert not torch.equal(_ours(model, options, seed=0), _ours(model, options, seed=1))


def test_finished_rows_are_padded_and_the_loop_stops_when_all_are_done(model) -> None:
    free = _ours(model, DecodeOptions(SamplingParams(max_tokens=12), pad_id=PAD))
    eos = {int(free[0, 2]), int(free[1, 4])}  # row 0 ends by step 3, row 1 by step 5
    ours = _ours(model, DecodeOptions(SamplingParams(max_tokens=12), pad_id=PAD, eos_ids=frozenset(eos)))
    theirs = _theirs(model, 12, do_sample=False, eos_token_id=sorted(eos))
    assert torch.equal(ours, theirs)
    assert ours.shape[1] <= 5
    for row in ours.tolist():
        end = next(i for i, token in enumerate(row) if token in eos)
        assert all(token == PAD for token in row[end + 1 :])


def test_quantized_kv_cache_decodes_like_generate_with_it(llama) -> None:
    spec = kv_spec_for(llama, None, 8, dynamic=True)
    assert spec is not None
    ours = _ours(llama, DecodeOptions(SamplingParams(max_tokens=10), pad_id=PAD), cache=SqueezeKVCache(spec))
    theirs = _theirs(llama, 10, cache=SqueezeKVCache(spec), do_sample=False)
    assert torch.equal(ours, theirs)


def test_one_forward_per_new_token_and_none_after_the_last(model) -> None:
    calls: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        _ours(model, DecodeOptions(SamplingParams(max_tokens=6), pad_id=PAD))
    finally:
        handle.remove()
    assert calls == [(2, 7)] + [(2, 1)] * 5


def test_processors_follow_generates_conditions() -> None:
    assert len(DecodeOptions(SamplingParams(max_tokens=1)).processors()) == 0  # greedy
    assert len(DecodeOptions(SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0)).processors()) == 0  # both no-ops
    chain = DecodeOptions(SamplingParams(max_tokens=1, temperature=0.5, top_p=0.9)).processors()
    assert [type(p) for p in chain] == [TemperatureLogitsWarper, TopPLogitsWarper]
    assert DecodeOptions(SamplingParams(max_tokens=1, temperature=0.5)).do_sample
    assert not DecodeOptions(SamplingParams(max_tokens=1)).do_sample


def test_generate_on_stories_equals_model_generate_for_a_sampled_batch(stories_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_pretrained(stories_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    prompts = ["Once upon a time there", "The cat"]
    result = generate(net, tokenizer, prompts, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=5)
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(5)
    with torch.inference_mode():
        out = net.generate(
            **batch,
            max_new_tokens=30,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            top_k=0,
            pad_token_id=tokenizer.eos_token_id,
            **{cache_kwarg(net): DynamicCache(config=net.config)},
        )
    for prompt, row, text, count in zip(
        prompts, out[:, batch["input_ids"].shape[1] :].tolist(), result.texts, result.new_tokens, strict=True
    ):
        cut = next((i + 1 for i, token in enumerate(row) if token == tokenizer.eos_token_id), len(row))
        # the text is read after the prompt (its first word keeps its space): prompt + text reads as both decoded
        ids = tokenizer(prompt)["input_ids"]
        assert (prompt + text, count) == (tokenizer.decode(ids + row[:cut], skip_special_tokens=True), cut)


FAMILY_SETTINGS = {  # sliding windows shorter than prompt + new tokens, so local layers really drop keys
    "MistralConfig": {"sliding_window": 4},
    "Gemma2Config": {"head_dim": 16, "sliding_window": 4},  # soft-capped logits, alternating local layers
    "Gemma3TextConfig": {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "Phi3Config": {},
    "Qwen3Config": {"head_dim": 16},
}


@pytest.mark.parametrize("config_name", sorted(FAMILY_SETTINGS))
def test_decode_equals_generate_across_families(config_name: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        **FAMILY_SETTINGS[config_name],
    )
    net = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        net.get_output_embeddings().weight.mul_(40)
    greedy = DecodeOptions(SamplingParams(max_tokens=10), pad_id=PAD)
    assert torch.equal(_ours(net, greedy), _theirs(net, 10, do_sample=False))
    sampled = DecodeOptions(SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9), pad_id=PAD)
    theirs = _theirs(net, 10, seed=2, do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
    assert torch.equal(_ours(net, sampled, seed=2), theirs)
