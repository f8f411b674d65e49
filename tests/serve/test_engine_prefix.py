"""Prefix caching end to end: the same tokens with and without the cache, shared prefixes under preemption."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from squeeze import api
from squeeze.runtime.options import KVOptions
from squeeze.serve.engine.engine import Engine
from squeeze.serve.engine.sampling import sample_step
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.types import EngineConfig, RequestOutput, SamplingParams

SYSTEM = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine with her "
    "friends. One day, she found a big red ball under a tree. "
)
ENDINGS = ["She", "Tom said", "The ball was", "Lily and her mom went to the park and", "Then", "A bird"]


def _engine(artifact: Path, **options) -> Engine:  # noqa: ANN003
    options.setdefault("kv_memory_bytes", 4 << 20)
    options.setdefault("block_size", 8)
    kv = KVOptions(options.pop("kv_bits", None), options.pop("kv_dynamic", False))
    return api.serve_engine(artifact, config=EngineConfig(kv=kv, **options))


def _serve(engine: Engine, waves: list[list[tuple[str, SamplingParams]]]) -> list[list[RequestOutput]]:
    """Each wave's requests at once, the waves one after another; every request's updates, in order."""

    async def one(prompt: str, params: SamplingParams, request_id: str) -> list[RequestOutput]:
        handle = engine.submit(engine.tokenize(prompt), params, request_id)
        return [output async for output in handle]

    async def main() -> list[list[RequestOutput]]:
        engine.start()
        results: list[list[RequestOutput]] = []
        try:
            for w, wave in enumerate(waves):
                results += await asyncio.gather(*(one(p, s, f"w{w}-{i}") for i, (p, s) in enumerate(wave)))
        finally:
            engine.shutdown(5)
        return results

    return asyncio.run(main())


def _ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _waves(params: SamplingParams) -> list[list[tuple[str, SamplingParams]]]:
    # the first request fills the cache; the rest share its prefix (and the last one is the same prompt again)
    first = [(SYSTEM + ENDINGS[0], params)]
    return [first, [(SYSTEM + e, params) for e in ENDINGS[1:]] + first]


def test_greedy_tokens_are_the_same_with_and_without_the_prefix_cache(serve_artifact: Path) -> None:
    for kv_bits in (4, 16):
        cached = _engine(serve_artifact, kv_bits=kv_bits)
        with_cache = _serve(cached, _waves(SamplingParams(max_tokens=24)))
        without = _serve(_engine(serve_artifact, kv_bits=kv_bits, prefix_cache=False), _waves(SamplingParams(24)))
        assert [_ids(o) for o in with_cache] == [_ids(o) for o in without]
        stats = cached.stats()
        assert stats.prefix_cache_hits_total > 0.5 * stats.prefix_cache_queries_total
        assert stats.kv_blocks_free == stats.kv_blocks_total and 0 < stats.kv_blocks_cached < stats.kv_blocks_total
        cached.blocks.check()


def test_same_prefix_different_sampling_settings(serve_artifact: Path) -> None:
    greedy, sampled = SamplingParams(max_tokens=16), SamplingParams(16, temperature=0.9, top_p=0.9, seed=7)
    prompt = SYSTEM + ENDINGS[1]
    alone = [_serve(_engine(serve_artifact, prefix_cache=False), [[(prompt, p)]])[0] for p in (greedy, sampled)]
    engine = _engine(serve_artifact)
    together = _serve(engine, [[(SYSTEM + ENDINGS[0], greedy)], [(prompt, greedy), (prompt, sampled)]])
    assert [_ids(o) for o in together[1:]] == [_ids(o) for o in alone]
    assert _ids(alone[0]) != _ids(alone[1]) and engine.stats().prefix_cache_hits_total > 0


def test_shared_blocks_survive_preemption_under_a_tiny_pool(serve_artifact: Path) -> None:
    """A block a request holds is never evicted: the books balance after every step, and the text is the
    same as with a roomy pool and no cache."""
    params = SamplingParams(max_tokens=96)
    waves = [[(SYSTEM + e, params) for e in ENDINGS]]
    roomy = _serve(_engine(serve_artifact, kv_bits=4, max_model_len=256, prefix_cache=False), waves)
    probe = _engine(serve_artifact, kv_bits=4, max_model_len=256)
    sinks = probe.pool.nbytes - probe.pool.num_blocks * probe.pool.block_bytes
    engine = _engine(serve_artifact, kv_bits=4, max_model_len=256, kv_memory_bytes=sinks + 40 * probe.pool.block_bytes)
    assert engine.stats().kv_blocks_total == 40
    step = engine._step

    def checked_step() -> None:
        step()
        engine.blocks.check()

    engine._step = checked_step  # type: ignore[method-assign]
    tight = _serve(engine, waves)
    assert [_ids(o) for o in tight] == [_ids(o) for o in roomy]
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.kv_blocks_cached > 0


def test_a_cached_prefix_gives_the_logits_bit_for_bit(wide32_artifact: Path) -> None:
    """The suffix computed over cached blocks gets the logits a whole prefill gets (a model whose widths are
    multiples of 32: see the wide32_artifact fixture)."""
    config = EngineConfig(kv=KVOptions(4, True), kv_memory_bytes=4 << 20, block_size=8)
    words = "the little dog found a big red ball under the tree and ran home to show his mother "
    order = iter(range(100))

    def logits(engine: Engine, text: str) -> tuple[torch.Tensor, int]:
        seq = Sequence(f"q{next(order)}", engine.tokenize(text), SamplingParams(1), order=next(order))
        engine.scheduler.add(seq)
        plan = engine.scheduler.schedule()
        assert [c.seq for c in plan] == [seq]
        with torch.inference_mode():
            out = engine.runner.run(plan)[0]
        # names its blocks, and finishes it (max_tokens 1)
        engine.scheduler.update(plan, sample_step(plan, out[None], {}, engine.masks))
        return out, plan[0].tokens

    cached = api.serve_engine(wide32_artifact, config=config)
    fresh = api.serve_engine(wide32_artifact, config=EngineConfig(**{**vars(config), "prefix_cache": False}))
    logits(cached, words * 3)
    for text in (words * 3 + "and", words * 2 + "a cat", words * 3):
        hit, computed = logits(cached, text)
        whole, _ = logits(fresh, text)
        assert computed < len(cached.tokenize(text)) and torch.equal(hit, whole), text
