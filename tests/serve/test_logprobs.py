"""Log-probabilities from the engine on stories260K: the prompt's agree with squeeze eval's per-token NLL, the
generated tokens' are those of the model's own distribution, and max_tokens 0 only scores."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from squeeze import api
from squeeze.eval.perplexity import token_nlls
from squeeze.runtime.options import KVOptions
from squeeze.serve.engine.engine import Engine
from squeeze.serve.types import EngineConfig, RequestOutput, SamplingParams

TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.",
    "Tom and his dog went to the park.",
    "The sun",
]


@pytest.fixture(scope="module")
def engine16(serve_artifact: Path) -> Engine:
    # a small batch budget: the long prompt is fed in several chunks, its log-probabilities gathered across them
    config = EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20, max_batch_tokens=8)
    return api.serve_engine(serve_artifact, config=config)


_REQUEST_IDS = itertools.count()  # unique ids: a finished request may still hold its id for a moment


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[RequestOutput]]:
    async def one(i: int, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
        return [o async for o in engine.submit(ids, params, f"lp{i}-{next(_REQUEST_IDS)}")]

    async def main() -> list[list[RequestOutput]]:
        engine.start()
        return await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(requests)))

    return asyncio.run(main())


def test_prompt_logprobs_agree_with_squeeze_eval_nll(engine16: Engine, serve_artifact: Path) -> None:
    loaded = api.load(serve_artifact)
    prompts = [engine16.tokenize(t) for t in TEXTS]
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=3)
    results = _run(engine16, [(ids, params) for ids in prompts])
    for ids, outputs in zip(prompts, results, strict=True):
        (last,) = outputs  # score only: one final update, nothing generated
        assert last.finished and last.finish_reason == "length" and last.completion_tokens == 0 and last.text == ""
        entries = last.prompt_logprobs
        assert entries is not None and [e.token_id for e in entries] == ids
        assert entries[0].logprob is None and entries[0].top == ()
        expected = -token_nlls(loaded.model, torch.tensor([ids]))[0]
        got = torch.tensor([e.logprob for e in entries[1:]])
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
        for entry in entries[1:]:
            assert len(entry.top) == 3
            values = [lp for _, lp in entry.top]
            assert values == sorted(values, reverse=True) and entry.logprob <= values[0]


def test_generated_logprobs_are_the_models_distribution_before_temperature(engine16: Engine) -> None:
    ids = engine16.tokenize(TEXTS[1])
    greedy = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=0)
    hot = dataclasses.replace(greedy, temperature=1.7, seed=3)
    (greedy_out, hot_out) = _run(engine16, [(ids, greedy), (ids, hot)])
    tokens = [lp for o in greedy_out for lp in o.logprobs]
    assert [t.token_id for t in tokens] == [i for o in greedy_out for i in o.token_ids]
    for entry in tokens:  # greedy: the chosen token is the most likely one
        assert entry.top[0] == (entry.token_id, entry.logprob) and len(entry.top) == 2
    # sampled at temperature 1.7, the first token's log-probability is still the model's (the same position;
    # stories260K's widths leave float rounding to the batch: see the wide32_artifact fixture)
    first = hot_out[0].logprobs[0]
    assert [i for i, _ in first.top] == [i for i, _ in tokens[0].top]
    assert [lp for _, lp in first.top] == pytest.approx([lp for _, lp in tokens[0].top], abs=1e-4)
    prompt = greedy_out[-1].prompt_logprobs
    assert prompt is not None and len(prompt) == len(ids) and all(e.top == () for e in prompt)
    # the first generated token's log-probability continues the prompt's: scoring prompt + token agrees
    scored = _run(engine16, [([*ids, tokens[0].token_id], SamplingParams(max_tokens=0, prompt_logprobs=0))])
    last = scored[0][-1].prompt_logprobs
    assert last is not None and last[-1].logprob == pytest.approx(tokens[0].logprob, abs=1e-4)


def test_echo_over_http_gives_the_nll_squeeze_eval_gives(serve_artifact: Path) -> None:
    """What lm-evaluation-harness's local-completions sends, on the real engine: two prompts as token ids."""
    import httpx
    from fake_engine import serving

    from squeeze.serve.http.app import create_app

    engine = api.serve_engine(serve_artifact, config=EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20))
    loaded = api.load(serve_artifact)
    prompts = [engine.tokenize(t) for t in TEXTS[:2]]
    request = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as url:
        body = httpx.post(f"{url}/v1/completions", json=request, timeout=60).json()
        scored = httpx.post(f"{url}/v1/completions", json={**request, "max_tokens": 0}, timeout=60).json()
    for ids, choice, score in zip(prompts, body["choices"], scored["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
        expected = -token_nlls(loaded.model, torch.tensor([ids]))[0]
        got = torch.tensor(logprobs["token_logprobs"][1:-1])
        assert torch.allclose(got, expected, atol=1e-4, rtol=0)
        assert score["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
        # greedy: the generated token is the top one (lm-eval's is_greedy reads the same dicts)
        assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())
        assert "".join(logprobs["tokens"][:-1]).strip() == engine.detokenize(ids).strip()


def test_preempted_requests_keep_their_prompt_logprobs(serve_artifact: Path) -> None:
    """A sequence preempted mid-prompt or mid-generation is recomputed; its prompt log-probabilities are
    neither lost nor recorded twice."""
    roomy = api.serve_engine(
        serve_artifact, config=EngineConfig(kv=KVOptions(16), max_model_len=256, kv_memory_bytes=4 << 20)
    )
    pool = roomy.pool
    tight = api.serve_engine(
        serve_artifact,
        config=EngineConfig(
            kv=KVOptions(16), max_model_len=256, kv_memory_bytes=18 * pool.block_bytes, max_batch_tokens=32
        ),
    )
    prompts = [tight.tokenize(t) for t in TEXTS * 3]
    params = SamplingParams(max_tokens=96, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    expected = _run(roomy, [(ids, params) for ids in prompts])
    got = _run(tight, [(ids, params) for ids in prompts])
    assert tight.stats().preemptions_total > 0
    for ids, want, have in zip(prompts, expected, got, strict=True):
        a, b = want[-1].prompt_logprobs, have[-1].prompt_logprobs
        assert a is not None and b is not None and len(b) == len(ids) == len(a)
        assert [e.token_id for e in b] == ids
        assert [e.logprob for e in b[1:]] == pytest.approx([e.logprob for e in a[1:]], abs=1e-4)


def test_a_cached_prefix_still_gives_every_prompt_logprob(engine16: Engine) -> None:
    """The prefix cache (on by default) holds the prompt's blocks after the first request; a second request for
    its prompt's log-probabilities must not start after them (it needs every position's logits)."""
    assert engine16.config.prefix_cache
    ids = engine16.tokenize(TEXTS[0] + " " + TEXTS[0])  # a few full 16-token blocks
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1)
    (first,), (second,) = _run(engine16, [(ids, params)]), _run(engine16, [(ids, params)])
    warm = SamplingParams(max_tokens=1, temperature=0)  # a plain request between them reuses the cached blocks
    _run(engine16, [(ids, warm)])
    (third,) = _run(engine16, [(ids, params)])[0]
    for outputs in (first, second):
        assert len(outputs[-1].prompt_logprobs) == len(ids)
    assert [e.logprob for e in first[-1].prompt_logprobs] == [e.logprob for e in third.prompt_logprobs]
    assert engine16.stats().prefix_cache_hits_total > 0
