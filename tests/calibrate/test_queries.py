"""Query second moments (squeeze.calibrate.queries): golden sums, a differential check against the queries SDPA
receives, and the model left exactly as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from squeeze.calibrate.queries import ATTENTION, QueryMoments, query_moments


def test_query_moments_golden_grouped_by_kv_head() -> None:
    # 4 query heads over 2 KV heads: heads 0, 1 read KV head 0 and heads 2, 3 read KV head 1 (repeat_kv)
    query = torch.arange(1 * 4 * 3 * 2, dtype=torch.float32).reshape(1, 4, 3, 2)  # (B, Hq, T, D)
    moments = QueryMoments(kv_heads=2, skip=1)
    moments.add(0, query)
    moments.add(0, query)  # a second window: sums add, the mean stays
    (mean, missing) = moments.result(2)
    assert missing is None
    for kv_head, heads in ((0, (0, 1)), (1, (2, 3))):
        q = torch.cat([query[0, h, 1:] for h in heads]).double()  # (4, D): the positions after the skipped one
        torch.testing.assert_close(mean[kv_head], (q.T @ q / q.shape[0]).float(), rtol=0, atol=0)
    assert moments.counts[0] == 2 * 2 * 2  # two windows x two query heads x two positions per KV head


def test_query_moments_ignore_heads_that_do_not_group_and_windows_within_the_skip() -> None:
    moments = QueryMoments(kv_heads=2, skip=4)
    moments.add(0, torch.ones(1, 3, 8, 2))  # 3 query heads cannot share 2 KV heads
    moments.add(1, torch.ones(1, 4, 4, 2))  # nothing after the 4 skipped positions
    assert moments.result(2) == [None, None]


def _sdpa_queries(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """The query tensors SDPA receives, one per attention call, by patching torch's function (the reference)."""
    seen: list[torch.Tensor] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def record(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(query.detach().clone())
        return original(query, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = record
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    return seen


def test_query_moments_are_those_of_the_queries_sdpa_sees_and_leave_the_model_unchanged(tiny_llama) -> None:  # noqa: ANN001
    model, _ = tiny_llama
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(4, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    reference = _sdpa_queries(model, ids)  # (1, Hq, T, D) per layer, post-RoPE
    kv_heads = model.config.num_key_value_heads
    with query_moments(model, kv_heads, skip=2) as moments:
        assert moments is not None and model.config._attn_implementation == ATTENTION
        with torch.inference_mode():
            captured = model(input_ids=ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(captured, plain)  # the wrapper only reads the queries
    result = moments.result(model.config.num_hidden_layers)
    assert len(reference) == len(result) == model.config.num_hidden_layers
    for query, mean in zip(reference, result, strict=True):
        expected = QueryMoments(kv_heads, skip=2)
        expected.add(0, query)
        torch.testing.assert_close(mean, expected.result(1)[0], rtol=1e-6, atol=1e-7)


def test_query_moments_restore_the_attention_on_error_and_skip_eager_models(tiny_llama) -> None:  # noqa: ANN001
    model, _ = tiny_llama
    with pytest.raises(RuntimeError, match="boom"), query_moments(model, 2, 0):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"  # transformers' eager path bypasses the interface
    try:
        with query_moments(model, 2, 0) as moments:
            assert moments is None and model.config._attn_implementation == "eager"
    finally:
        model.config._attn_implementation = "sdpa"
