"""Speculative decoding in the engine (squeeze.runtime.speculation): the n-gram and int8 drafters give the same
tokens as plain decoding, greedy and seeded sampling, alone and in a batch; rejected drafts leave nothing behind
(blocks back in the pool, the prefix cache holding no rejected token); the metrics count drafts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from squeeze import api
from squeeze.errors import ConfigError
from squeeze.runtime.options import KVOptions
from squeeze.runtime.speculation import SpeculationOptions
from squeeze.serve.engine.engine import Engine
from squeeze.serve.types import EngineConfig, SamplingParams

PROMPTS = [
    "Once upon a time there was a little dog. The little dog liked to run. The little dog",
    "The cat sat on the mat. The cat sat on the",
    "Lily and Ben went to the park to play with a ball",
]


def _engine(
    artifact: Path, speculate: str, *, kv_bits: int | None = None, kv_dynamic: bool = False, **options: Any
) -> Engine:
    options.setdefault("kv_memory_bytes", 4 << 20)
    kv = KVOptions(kv_bits, kv_dynamic)
    config = EngineConfig(kv=kv, speculation=SpeculationOptions.parse(speculate), **options)
    return api.serve_engine(artifact, config=config)


def _generate(engine: Engine, params: list[SamplingParams], prompts: list[str]) -> list[list[int]]:
    """Every prompt submitted before the engine starts (so the first step admits them all); each request's ids."""

    async def main() -> list[list[int]]:
        try:
            handles = [
                engine.submit(engine.tokenize(p), sp, f"r{i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            engine.start()

            async def collect(handle: Any) -> list[int]:
                return [t async for out in handle for t in out.token_ids]

            return list(await asyncio.gather(*(collect(h) for h in handles)))
        finally:
            engine.shutdown(5)

    return asyncio.run(main())


@pytest.fixture(scope="module", params=[16, 8], ids=["kv16-sdpa", "kv8-native"])
def kv_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A full-precision pool (SDPA per row) and a dynamic int8 pool (the native attention kernel)."""
    return {"kv_bits": 16} if request.param == 16 else {"kv_bits": 8, "kv_dynamic": True}


@pytest.mark.parametrize("speculate", ["ngram:4", "int8:3"])
def test_greedy_tokens_are_those_of_plain_decoding(
    wide32_artifact: Path, kv_options: dict[str, Any], speculate: str
) -> None:
    greedy = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    plain = _generate(_engine(wide32_artifact, "off", **kv_options), greedy, PROMPTS)
    engine = _engine(wide32_artifact, speculate, **kv_options)
    together = _generate(engine, greedy, PROMPTS)
    stats = engine.stats()
    assert together == plain
    assert stats.spec_draft_tokens_total > 0  # it did speculate
    assert 0 <= stats.spec_accepted_tokens_total <= stats.spec_draft_tokens_total
    assert stats.generation_tokens_total == 24 * len(PROMPTS)
    alone = _generate(_engine(wide32_artifact, speculate, **kv_options), greedy[:1], PROMPTS[:1])
    assert alone == plain[:1]


def test_drafts_are_accepted_where_the_output_repeats(wide32_artifact: Path) -> None:
    """A tiny random model falls into loops: the n-gram drafter's copies of them are kept."""
    engine = _engine(wide32_artifact, "ngram:4", kv_bits=16)
    _generate(engine, [SamplingParams(max_tokens=64, ignore_eos=True)], PROMPTS[:1])
    stats = engine.stats()
    assert stats.spec_accepted_tokens_total > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total  # every block back (the cached ones count as free)
    engine.blocks.check()


def test_seeded_sampling_gives_the_same_tokens(wide32_artifact: Path) -> None:
    """Each position draws from the request's generator as plain decoding does (rejection sampling for a
    one-token proposal), so a seeded request's tokens are the same with and without speculation."""
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    plain = _generate(_engine(wide32_artifact, "off", kv_bits=16), params, PROMPTS)
    for speculate in ("ngram:4", "int8:2"):
        assert _generate(_engine(wide32_artifact, speculate, kv_bits=16), params, PROMPTS) == plain


def test_stops_and_limits_hold_inside_an_accepted_draft(wide32_artifact: Path) -> None:
    """max_tokens and stop strings end a request at the same token when a step would have emitted more."""
    for max_tokens in (1, 2, 5, 13):
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)]
        plain = _generate(_engine(wide32_artifact, "off", kv_bits=16), params, PROMPTS[:1])
        assert _generate(_engine(wide32_artifact, "ngram:8", kv_bits=16), params, PROMPTS[:1]) == plain


def test_rejected_drafts_never_reach_the_prefix_cache(wide32_artifact: Path) -> None:
    engine = _engine(wide32_artifact, "int8:4", kv_bits=16, block_size=4)
    prompt = PROMPTS[1]
    _generate(engine, [SamplingParams(max_tokens=16, ignore_eos=True)], [prompt])
    prompt_ids = engine.tokenize(prompt)
    cache = engine.blocks.cache
    assert cache is not None
    engine.blocks.check()
    # only full prompt blocks are ever named: a second request finds at most the prompt's blocks
    cached = engine.blocks.cached(cache.names(prompt_ids + [5] * 16), len(prompt_ids) + 16)
    assert len(cached) <= len(prompt_ids) // 4


def test_many_rows_turn_speculation_off(wide32_artifact: Path) -> None:
    """Beyond a few decoding rows the drafts' rows would be real compute: none are drafted."""
    engine = _engine(wide32_artifact, "int8:4", kv_bits=16)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(9)]
    _generate(engine, [SamplingParams(max_tokens=4, ignore_eos=True)] * 9, prompts)
    # with nine rows decoding from the first step on, no step verifies drafts
    assert engine.stats().spec_draft_tokens_total == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("off", "off"), ("ngram", "ngram:8"), ("ngram:2", "ngram:2"), ("int8:16", "int8:16")],
)
def test_the_option_parses(text: str, expected: str) -> None:
    assert str(SpeculationOptions.parse(text)) == expected


@pytest.mark.parametrize("text", ["ngram:0", "int8:17", "eagle:3", "ngram:x", "off:3", ""])
def test_bad_options_are_refused_with_a_hint(text: str) -> None:
    with pytest.raises(ConfigError, match="--speculate") as info:
        SpeculationOptions.parse(text)
    assert info.value.hint and "--speculate" in info.value.hint


@pytest.mark.parametrize("kv", [{"kv_bits": 16}, {"kv_bits": 8, "kv_dynamic": True}], ids=["sdpa", "native"])
def test_a_verification_row_gives_each_position_the_bits_of_decoding_it_alone(
    wide32_artifact: Path, kv: dict[str, Any]
) -> None:
    """The runner's logits for a row of 1 + d queries equal, bit for bit, those of d + 1 single-token steps."""
    import torch

    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence

    fed = [5, 9, 12, 7, 30]

    def prefilled(engine: Engine) -> Sequence:
        seq = Sequence("s", engine.tokenize(PROMPTS[0]), SamplingParams(max_tokens=16), order=1)
        engine.scheduler.add(seq)
        (chunk,) = engine.scheduler.schedule()
        engine.runner.run([chunk])
        seq.computed += chunk.tokens
        seq.output_ids.append(fed[0])
        return seq

    with torch.inference_mode():
        one = _engine(wide32_artifact, "off", **kv)
        seq = prefilled(one)
        alone = []
        for token in fed[1:] + [0]:
            (chunk,) = one.scheduler.schedule()
            alone.append(one.runner.run([chunk])[0])
            seq.computed += 1
            seq.output_ids.append(token)
        together = _engine(wide32_artifact, "off", **kv)
        seq = prefilled(together)
        (chunk,) = together.scheduler.schedule(lambda s: len(fed) - 1)
        assert chunk.room == len(fed) - 1
        verify = ScheduledChunk(seq, len(fed), draft=tuple(fed[1:]))
        _, rows = together.runner.run_keeping([verify], [True])
    assert torch.equal(rows[0], torch.stack(alone))


def test_verification_samples_the_target_distribution() -> None:
    """Seeded statistics on a 4-token vocabulary: a verification row's first token is distributed as the
    exact path's p0 (the draft changes nothing), the draft is kept with probability p0[draft] (rejection
    sampling's acceptance for a one-token proposal), and the token after a kept draft follows p1."""
    import torch

    from squeeze.serve.engine.sampling import sample_step
    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence

    p0, p1 = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.stack([p0.log(), p1.log()])  # (1 + k, V), k = 1
    seq = Sequence("s", [1, 2], SamplingParams(max_tokens=8, temperature=1.0, seed=0), order=1)
    draft = 2
    chunk = ScheduledChunk(seq, 2, draft=(draft,))
    trials = 20_000
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(trials):
        (sampled,) = sample_step([chunk], logits[:1], {0: logits}, masks=None)  # type: ignore[arg-type]
        assert sampled is not None
        first[sampled.tokens[0]] += 1
        if len(sampled.tokens) == 2:
            assert sampled.tokens[0] == draft
            second[sampled.tokens[1]] += 1

    def close(counts: torch.Tensor, p: torch.Tensor) -> bool:  # every frequency within 5 standard deviations
        n = counts.sum()
        return bool(((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all())

    assert close(first, p0)
    assert second.sum() == first[draft]  # a kept draft always yields the next position's token
    assert close(second, p1)


def test_the_ngram_drafter_looks_each_row_up_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculator.room proposes each decoding row's n-gram draft (its length sizes the row's blocks); draft()
    reuses that proposal, cut to the room the scheduler left the row, instead of looking the index up again."""
    from squeeze.runtime.speculation import NgramIndex
    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence
    from squeeze.serve.engine.speculation import Speculator

    calls: list[int] = []
    propose = NgramIndex.propose

    def spy(self: NgramIndex, k: int) -> list[int]:
        calls.append(k)
        return propose(self, k)

    monkeypatch.setattr(NgramIndex, "propose", spy)
    speculator = Speculator(SpeculationOptions.parse("ngram:4"), runner=None, max_model_len=64)  # type: ignore[arg-type]
    seqs = [Sequence(f"s{i}", [1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(max_tokens=16), order=i) for i in range(2)]
    for seq in seqs:
        speculator.admit(seq)
        seq.computed = seq.length - 1  # decoding: the newest token is pending
    room = speculator.room(seqs)
    assert room is not None and [room(seq) for seq in seqs] == [4, 4]
    plan = [ScheduledChunk(seqs[0], 1, room=4), ScheduledChunk(seqs[1], 1, room=2)]  # the second row's room cut
    drafted = speculator.draft(plan)
    assert [(chunk.tokens, chunk.draft) for chunk in drafted] == [(5, (4, 5, 1, 2)), (3, (4, 5))]
    assert calls == [4, 4]
