"""squeeze.runtime.fast_path: the flat Llama-shape forward computes transformers' forward (same ops), and
every other family or configuration keeps transformers' forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from squeeze.runtime.attention import native_run
from squeeze.runtime.decode import DecodeOptions, decode, prefill
from squeeze.runtime.fast_path import fast_forward, fast_path_supported
from squeeze.runtime.kernels.cpu_attention import attention_kernels
from squeeze.runtime.kv_selection import kv_spec_for
from squeeze.runtime.quantized_cache import SqueezeKVCache
from squeeze.runtime.sampling_params import SamplingParams


def _sdpa_attend(cache: DynamicCache) -> Any:
    """The attention transformers' SDPA path runs: the cache's update, then sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        key, value = cache.update(key, value, module.layer_idx)
        out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=module.scaling, dropout=0.0)
        return out  # type: ignore[no-any-return]

    return attend


def _compare_with_transformers(model: Any, vocab: int) -> None:
    """A 7-token prompt then 3 decode steps, every position's logits, both ways (fresh caches)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (1, 10), generator=gen)
    ours_cache, theirs_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    attend = _sdpa_attend(ours_cache)
    with torch.inference_mode():
        for start, stop in ((0, 7), (7, 8), (8, 9), (9, 10)):
            chunk, positions = ids[:, start:stop], torch.arange(start, stop)[None]
            ours = fast_forward(model, chunk, positions, attend, stop - start)
            theirs = model(input_ids=chunk, position_ids=positions, cache=theirs_cache, logits_to_keep=stop - start)
            assert ours.shape == theirs.logits.shape
            torch.testing.assert_close(ours, theirs.logits, atol=0, rtol=0)  # the same operations: the same bits


def test_the_flat_forward_equals_transformers_forward_on_the_tiny_llama(tiny_llama: Any) -> None:
    model, _ = tiny_llama
    assert fast_path_supported(model)
    _compare_with_transformers(model, model.config.vocab_size)


def test_the_flat_forward_equals_transformers_forward_on_stories260k(stories: Any) -> None:
    model, _ = stories
    assert fast_path_supported(model)
    _compare_with_transformers(model, model.config.vocab_size)


def _tiny(config_name: str, **changes: Any) -> Any:
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
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **changes,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("config_name", "changes"),
    [
        ("Qwen3Config", {"head_dim": 16}),  # q / k norms
        ("Qwen2Config", {}),  # q / k / v biases
        (
            "LlamaConfig",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
    ],
)
def test_the_flat_forward_equals_transformers_forward_across_the_llama_shape(
    config_name: str, changes: dict[str, Any]
) -> None:
    model = _tiny(config_name, **changes)
    assert fast_path_supported(model)
    _compare_with_transformers(model, 97)


@pytest.mark.parametrize(
    ("config_name", "changes"),
    [
        ("MistralConfig", {"sliding_window": 4}),
        ("Gemma2Config", {"head_dim": 16, "sliding_window": 4}),
        ("Phi3Config", {}),
        ("LlamaConfig", {"hidden_act": "gelu"}),
        ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    ],
)
def test_other_families_and_configurations_keep_transformers_forward(config_name: str, changes: dict[str, Any]) -> None:
    assert not fast_path_supported(_tiny(config_name, **changes))


def test_the_switch_turns_it_off(tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_llama
    monkeypatch.setenv("SQUEEZE_FAST_PATH", "0")
    assert not fast_path_supported(model)


def _native_decode(model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, fast: str) -> tuple[Any, Any]:
    """Greedy 32 tokens over an int4 cache attended natively; (tokens, first logits)."""
    monkeypatch.setenv("SQUEEZE_FAST_PATH", fast)
    spec = kv_spec_for(model, None, 4, dynamic=True)
    assert spec is not None
    cache = SqueezeKVCache(spec)
    batch = tokenizer(["Once upon a time", "The little dog ran to the"], return_tensors="pt", padding=True)
    with torch.inference_mode(), native_run(model, cache, batch["attention_mask"]) as extra:
        assert extra, "the run should attend natively"
        state = prefill(model, batch["input_ids"], batch["attention_mask"], cache, extra)
        assert (state.fast_attend is not None) == (fast == "1")
        first = state.logits.clone()
        tokens = decode(model, state, DecodeOptions(SamplingParams(max_tokens=32), pad_id=0))
    return tokens, first


def test_squeeze_run_takes_the_flat_forward_and_gives_transformers_text_on_stories260k(
    stories: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if attention_kernels() is None:
        pytest.skip("no C++ compiler: the native attention kernel is not built")
    model, tokenizer = stories
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    fast_tokens, fast_logits = _native_decode(model, tokenizer, monkeypatch, "1")
    slow_tokens, slow_logits = _native_decode(model, tokenizer, monkeypatch, "0")
    torch.testing.assert_close(fast_logits, slow_logits, atol=0, rtol=0)  # the same operations: the same bits
    assert torch.equal(fast_tokens, slow_tokens)
