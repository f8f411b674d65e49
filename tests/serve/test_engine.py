"""The engine end to end on stories260K: batch-independent greedy output, preemption, cancellation, limits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from squeeze import api
from squeeze.errors import ConfigError
from squeeze.runtime.options import KVOptions
from squeeze.serve.engine.engine import Engine
from squeeze.serve.types import EngineConfig, QueueFullError, RequestError, RequestOutput, SamplingParams

PROMPTS = [
    "Once upon a time",
    "Lily and Tom",
    "The dog ran to the park",
    "One day, a little girl named",
    "The sun was",
    "Tim had a big red ball. He",
    "There was a cat",
    "Mom said",
    "The bird flew over the tree and",
    "Sam liked to",
    "In the garden",
    "The boy was sad because",
    "Once upon a time, there was a little boat",
    "She found a",
    "They played all day",
    "The old man",
    # longer than 32 tokens: prompts of many rows, through the same kernels
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine with her "
    "friends. One day, she found a big red ball under a tree",
    "Tom and his dog went to the park. They played with a stick and ran around the big green trees until",
]


def _engine(artifact: Path, activations: str = "float32", **options) -> Engine:  # noqa: ANN003
    options.setdefault("kv_memory_bytes", 4 << 20)
    kv = KVOptions(options.pop("kv_bits", None), options.pop("kv_dynamic", False))
    config = EngineConfig(kv=kv, **options)
    return api.serve_engine(artifact, config=config, activations=activations)  # type: ignore[arg-type]


async def _collect(engine: Engine, prompt: str, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    handle = engine.submit(engine.tokenize(prompt), params, request_id)
    return [output async for output in handle]


def _generate_all(engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[RequestOutput]]:
    async def main() -> list[list[RequestOutput]]:
        engine.start()
        try:
            return await asyncio.gather(*(_collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
        finally:
            engine.shutdown(5)

    return asyncio.run(main())


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


@pytest.mark.parametrize(("kv_bits", "activations"), [(4, "float32"), (16, "float32"), (4, "int8")])
def test_sixteen_concurrent_prompts_give_what_squeeze_run_gives_each_alone(
    serve_artifact: Path, kv_bits: int, activations: str
) -> None:
    options = {"kv_bits": kv_bits, "max_batch_tokens": 24, "max_num_seqs": 16, "block_size": 8}
    engine = _engine(serve_artifact, activations, **options)
    results = _generate_all(engine, PROMPTS, SamplingParams(max_tokens=24))
    loaded = api.load(serve_artifact, activations=activations)  # type: ignore[arg-type]
    for prompt, outputs in zip(PROMPTS, results, strict=True):
        alone = api.generate(loaded, prompt, max_new_tokens=24, kv_bits=kv_bits)
        assert _text(outputs) == alone.text, prompt
        assert outputs[-1].completion_tokens == alone.new_tokens[0]
        assert outputs[-1].finish_reason == ("stop" if alone.new_tokens[0] < 24 else "length")
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_running == stats.requests_waiting == 0
    assert stats.requests_finished_total == len(PROMPTS) and stats.kv_bits == kv_bits
    assert stats.kv_cache == {4: "int4", 16: "float32"}[kv_bits]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_preempted_sequences_are_recomputed_and_give_the_same_text(serve_artifact: Path, activations: str) -> None:
    roomy_engine = _engine(serve_artifact, activations, kv_bits=4, max_model_len=256)
    roomy = _generate_all(roomy_engine, PROMPTS[:8], SamplingParams(max_tokens=128))
    pool = roomy_engine.pool
    sinks = pool.nbytes - pool.num_blocks * pool.block_bytes
    # blocks for one full 256-token sequence and two more: 8 sequences of ~135 tokens must take turns
    engine = _engine(
        serve_artifact, activations, kv_bits=4, max_model_len=256, kv_memory_bytes=sinks + 18 * pool.block_bytes
    )
    assert engine.stats().kv_blocks_total == 18
    tight = _generate_all(engine, PROMPTS[:8], SamplingParams(max_tokens=128))
    assert [_text(o) for o in tight] == [_text(o) for o in roomy]
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.kv_blocks_free == stats.kv_blocks_total


def test_seeded_sampling_does_not_depend_on_the_batch(serve_artifact: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    alone = _generate_all(_engine(serve_artifact), [PROMPTS[0]], params)
    crowded = _generate_all(_engine(serve_artifact), [PROMPTS[0], *PROMPTS[1:6]], params)
    assert _text(crowded[0]) == _text(alone[0])
    other_seed = _generate_all(_engine(serve_artifact), [PROMPTS[0]], SamplingParams(16, 0.9, 0.9, seed=99))
    greedy = _generate_all(_engine(serve_artifact), [PROMPTS[0]], SamplingParams(16))
    assert len({_text(alone[0]), _text(other_seed[0]), _text(greedy[0])}) > 1  # sampling does sample


def test_a_stop_string_ends_the_text_before_it(serve_artifact: Path) -> None:
    full = _text(_generate_all(_engine(serve_artifact), [PROMPTS[0]], SamplingParams(max_tokens=24))[0])
    stop = full[10:13]
    outputs = _generate_all(_engine(serve_artifact), [PROMPTS[0]], SamplingParams(max_tokens=24, stop=("zzz", stop)))
    assert _text(outputs[0]) == full[: full.index(stop)]
    assert outputs[0][-1].finish_reason == "stop"


def test_cancelling_a_request_frees_its_blocks(serve_artifact: Path) -> None:
    engine = _engine(serve_artifact)

    async def main() -> tuple[list[RequestOutput], int]:
        engine.start()
        try:
            handle = engine.submit(engine.tokenize(PROMPTS[0]), SamplingParams(max_tokens=400), "long")
            seen = []
            async for output in handle:
                seen.append(output)
                if len(seen) == 3:
                    break
            held = engine.stats().kv_blocks_total - engine.stats().kv_blocks_free
            handle.cancel()
            for _ in range(500):  # bounded: the engine handles the cancellation before its next step
                if engine.stats().kv_blocks_free == engine.stats().kv_blocks_total:
                    break
                await asyncio.sleep(0.01)
            return seen, held
        finally:
            engine.shutdown(1)

    seen, held = asyncio.run(main())
    assert len(seen) == 3 and held > 0
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_running == 0


def test_shutdown_cancels_what_does_not_finish_within_the_grace_period(serve_artifact: Path) -> None:
    engine = _engine(serve_artifact)

    async def main() -> list[RequestOutput]:
        engine.start()
        handle = engine.submit(engine.tokenize(PROMPTS[0]), SamplingParams(max_tokens=480), "long")
        first = await handle.__aiter__().__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 0.0)
        with pytest.raises(RequestError, match="shutting down"):
            engine.submit([1, 2], SamplingParams(max_tokens=1), "late")
        return [first] + [output async for output in handle]

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_requests_beyond_the_context_or_the_queue_are_refused(serve_artifact: Path) -> None:
    engine = _engine(serve_artifact, max_queue=2, max_model_len=64)  # not started: requests stay queued

    async def main() -> None:
        ids = engine.tokenize(PROMPTS[0])
        with pytest.raises(RequestError, match=r"more than the context of 64 tokens") as caught:
            engine.submit(ids, SamplingParams(max_tokens=64 - len(ids) + 1), "long")
        assert caught.value.status == 400 and caught.value.param == "max_tokens"
        engine.submit(ids, SamplingParams(max_tokens=64 - len(ids)), "a")
        engine.submit(ids, SamplingParams(max_tokens=1), "b")
        with pytest.raises(QueueFullError) as full:
            engine.submit(ids, SamplingParams(max_tokens=1), "c")
        assert full.value.status == 429 and full.value.retry_after >= 1
        with pytest.raises(RequestError, match="out of range|must lie in"):
            engine.tokenize([1, 10**6])
        with pytest.raises(RequestError, match="empty"):
            engine.submit([], SamplingParams(max_tokens=1), "d")

    asyncio.run(main())


def test_bad_engine_options_are_refused_before_loading(serve_artifact: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(ConfigError, match="--max-num-seqs must be a positive integer"):
        api.serve_engine(missing, config=EngineConfig(max_num_seqs=0))
    with pytest.raises(ConfigError, match="prefix_cache must be True or False, found 'yes'"):
        api.serve_engine(missing, config=EngineConfig(prefix_cache="yes"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--kv-bits must be 4, 8 or 16"):
        api.serve_engine(missing, config=EngineConfig(kv=KVOptions(5)))
    with pytest.raises(ConfigError, match="--kv-memory .* one sequence of the full context"):
        _engine(serve_artifact, kv_memory_bytes=1000)
    with pytest.raises(ConfigError, match="--max-model-len 100000 is more than the model's context of 512"):
        _engine(serve_artifact, max_model_len=100000)
    with pytest.raises(ConfigError, match="calibrated for int4"):
        _engine(serve_artifact, kv_bits=8)
    assert _engine(serve_artifact, kv_bits=8, kv_dynamic=True).stats().kv_bits == 8


def test_int4_kv_without_calibration_is_refused_with_the_calibrate_kv_hint(compress_tiny, tmp_path: Path) -> None:
    artifact = compress_tiny(tmp_path / "tiny-w4")
    with pytest.raises(ConfigError, match="needs calibrated KV scales") as caught:
        api.serve_engine(artifact, config=EngineConfig(kv=KVOptions(4)))
    assert "squeeze calibrate-kv" in (caught.value.hint or "")
    assert api.serve_engine(artifact).stats().kv_bits == 16  # default: what the artifact has (no KV: full precision)


def test_a_tampered_artifact_is_refused(artifact_copy: Path) -> None:
    from squeeze.errors import IntegrityError

    shard = next(artifact_copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        api.serve_engine(artifact_copy)


def test_a_row_gets_the_same_logits_bit_for_bit_alone_or_packed_with_others(wide32_artifact: Path) -> None:
    """A packed step's rows get the logits squeeze run gives them alone, bit for bit: the LUT linears and the LM
    head sum each output in one order at every row count (a short prompt, a long one, both in one step).

    A tiny Llama whose widths are multiples of 32 (see the wide32_artifact fixture): at stories260K's
    intermediate size of 172, torch's SiLU gives a row's last elements other bits when they end the tensor.
    """
    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence

    engine = api.serve_engine(wide32_artifact, config=EngineConfig(kv=KVOptions(4, True), kv_memory_bytes=4 << 20))
    short = engine.tokenize("once upon a time")
    long = engine.tokenize(" ".join(["the little dog found a big red ball under the tree"] * 4))
    assert len(short) < 32 < len(long)

    def logits(*prompts: list[int]) -> torch.Tensor:
        seqs = [Sequence(f"q{i}-{len(prompts)}", p, SamplingParams(1), order=i) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.blocks.grow(seq.seq_id, len(seq.prompt_ids))
        try:
            with torch.inference_mode():
                return engine.runner.run([ScheduledChunk(seq, len(seq.prompt_ids)) for seq in seqs])
        finally:
            for seq in seqs:
                engine.blocks.release(seq.seq_id)

    alone = [logits(short)[0], logits(long)[0]]
    packed = logits(short, long, short)  # one step of 2 + len(long) rows
    assert torch.equal(packed[0], alone[0]) and torch.equal(packed[1], alone[1]) and torch.equal(packed[2], alone[0])


def test_run_drives_the_loop_in_the_calling_thread_until_shutdown(serve_artifact: Path) -> None:
    """squeeze serve's arrangement: the engine in the main thread, the event loop (clients) in another."""
    import threading

    engine = _engine(serve_artifact)
    texts: list[str] = []

    def clients() -> None:
        async def main() -> None:
            engine.start()  # what the HTTP app's lifespan does: a no-op once the loop is claimed
            outputs = await _collect(engine, PROMPTS[0], SamplingParams(max_tokens=8), "r0")
            texts.append(_text(outputs))

        try:
            asyncio.run(main())
        finally:
            engine.shutdown(1)  # blocks until the loop in the other thread has stopped

    engine.claim_loop()
    thread = threading.Thread(target=clients)
    thread.start()
    engine.run(until=lambda: not thread.is_alive())
    thread.join(timeout=60)
    assert not thread.is_alive() and engine._thread is None  # no thread of its own was started
    loaded = api.load(serve_artifact)
    assert texts == [api.generate(loaded, PROMPTS[0], max_new_tokens=8, kv_bits=4).text]
    with pytest.raises(RuntimeError, match="own thread"):
        other = _engine(serve_artifact)
        other.start()
        try:
            other.claim_loop()
        finally:
            other.shutdown(0)
