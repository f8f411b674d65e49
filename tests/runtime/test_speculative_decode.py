"""squeeze run's speculative decoding (squeeze.runtime.speculative_decode): the same tokens as plain decoding,
greedy and seeded, one prompt and a left-padded batch, on the SDPA path (full-precision cache) and the native
attention path (quantized cache); the quantized cache crops back exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze import api
from squeeze.errors import ConfigError
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.quantized_cache import SqueezeKVCache

PROMPTS = [
    "Once upon a time there was a little dog. The little dog liked to run. The little dog",
    "The cat sat on the mat. The cat sat on the",
    "Lily and Ben went to the park",
]


@pytest.fixture(scope="module")
def loaded(wide32_artifact: Path) -> Any:
    return api.load(wide32_artifact)


@pytest.mark.parametrize("kv_bits", [16, 8], ids=["sdpa", "native"])
@pytest.mark.parametrize("speculate", ["ngram:4", "int8:3"])
def test_greedy_tokens_match_plain_decoding(loaded: Any, kv_bits: int, speculate: str) -> None:
    kv = {"kv_bits": kv_bits, "kv_dynamic": kv_bits == 8}
    for prompts in (PROMPTS[:1], PROMPTS):
        plain = api.generate(loaded, prompts, max_new_tokens=24, **kv)
        fast = api.generate(loaded, prompts, max_new_tokens=24, speculate=speculate, **kv)
        assert fast.texts == plain.texts
        assert fast.new_tokens == plain.new_tokens
        assert fast.speculation == speculate and fast.spec_draft_tokens > 0
        assert 0 <= fast.spec_accepted_tokens <= fast.spec_draft_tokens


def test_seeded_sampling_matches(loaded: Any) -> None:
    options = {"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    plain = api.generate(loaded, PROMPTS, **options)
    for speculate in ("ngram:3", "int8:2"):
        assert api.generate(loaded, PROMPTS, speculate=speculate, **options).texts == plain.texts


def test_the_limit_ends_a_run_inside_an_accepted_draft(loaded: Any) -> None:
    for n in (1, 2, 3, 9):
        plain = api.generate(loaded, PROMPTS[1], max_new_tokens=n)
        fast = api.generate(loaded, PROMPTS[1], max_new_tokens=n, speculate="ngram:8")
        assert fast.texts == plain.texts and fast.new_tokens == plain.new_tokens == [n]


def test_a_bad_option_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--speculate"):
        api.generate(tmp_path / "missing", "hi", speculate="ngram:0")


def test_the_quantized_cache_crops_to_what_it_held() -> None:
    """Cropping n tokens then appending n others leaves the cache as if only the others had come."""
    torch.manual_seed(0)
    spec = KVSpec.dynamic(8, ("a",), sink_tokens=2)
    keys = torch.randn(1, 2, 9, 16)
    values = torch.randn(1, 2, 9, 16)
    other_k, other_v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    cropped = SqueezeKVCache(spec)
    cropped.update(keys, values, 0)
    cropped.crop(-3)
    assert cropped.get_seq_length() == 6
    got_k, got_v = cropped.update(other_k, other_v, 0)
    direct = SqueezeKVCache(spec)
    want_k, want_v = direct.update(
        torch.cat([keys[:, :, :6], other_k], 2), torch.cat([values[:, :, :6], other_v], 2), 0
    )
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    cropped.crop(-8)  # into the sink
    assert cropped.get_seq_length() == 1
    with pytest.raises(ValueError, match="negative"):
        cropped.crop(2)


@pytest.mark.parametrize("kv_bits", [16, 8], ids=["sdpa", "native"])
def test_a_verifying_forward_gives_each_position_the_bits_of_decoding_it_alone(loaded: Any, kv_bits: int) -> None:
    """The logits of d + 1 positions fed at once equal, bit for bit, those of feeding them one at a time."""
    from transformers import DynamicCache

    from squeeze.runtime.attention import native_run
    from squeeze.runtime.decode import decode_step, prefill
    from squeeze.runtime.speculative_decode import _verify

    model, tokenizer = loaded.model, loaded.tokenizer
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    fed = torch.tensor([[5, 9, 12, 7, 30], [8, 8, 41, 3, 17]])

    def cache() -> Any:
        layers = ("x",) * model.config.num_hidden_layers
        return SqueezeKVCache(KVSpec.dynamic(8, layers, 4)) if kv_bits == 8 else DynamicCache()

    with torch.inference_mode():
        one = cache()
        with native_run(model, one, batch["attention_mask"]) as extra:
            state = prefill(model, batch["input_ids"], batch["attention_mask"], one, extra)
            alone = []
            for i in range(fed.shape[1]):
                decode_step(model, state, fed[:, i])
                alone.append(state.logits)
        together = cache()
        with native_run(model, together, batch["attention_mask"]) as extra:
            state = prefill(model, batch["input_ids"], batch["attention_mask"], together, extra)
            logits = _verify(model, state, fed[:, 0], fed[:, 1:])
    assert torch.equal(logits, torch.stack(alone, dim=1))


def test_the_sdpa_verify_attention_is_registered_once_not_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entering the verifying context twice on an SDPA model registers the verify attention (and its mask) with
    transformers once, and restores the model's attention implementation each time."""
    from types import SimpleNamespace

    from transformers import AttentionInterface, AttentionMaskInterface

    from squeeze.runtime import speculative_decode as sd

    calls: list[tuple[str, str]] = []
    for interface in (AttentionInterface, AttentionMaskInterface):
        register = interface.register  # the bound classmethod: the spy still registers

        def spy(key: str, value: Any, register: Any = register, name: str = interface.__name__) -> None:
            calls.append((name, key))
            register(key, value)

        monkeypatch.setattr(interface, "register", spy)
    sd._register_verify_attention.cache_clear()
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    for _ in range(2):
        with sd._verifying(model):  # type: ignore[arg-type]
            assert model.config._attn_implementation == sd.VERIFY_ATTENTION
        assert model.config._attn_implementation == "sdpa"
    assert sorted(calls) == [
        ("AttentionInterface", sd.VERIFY_ATTENTION),
        ("AttentionMaskInterface", sd.VERIFY_ATTENTION),
    ]
    assert AttentionInterface._global_mapping[sd.VERIFY_ATTENTION] is sd.verify_attention
