"""squeeze serve's steps take squeeze.runtime.fast_path's flat forward over the paged pool (natively attended
Llama-shaped models): the same logits as transformers' forward, the same bits for a row alone or in a batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import squeeze.serve.engine.runner as serve_runner
from squeeze import api
from squeeze.runtime.kernels.cpu_attention import attention_kernels
from squeeze.runtime.options import KVOptions
from squeeze.serve.engine.scheduler import ScheduledChunk
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.types import EngineConfig, SamplingParams

PROMPTS = ("once upon a time", "the little dog found a big red ball", "she saw a cat and the cat saw a bird in a tree")


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if attention_kernels() is None:
        pytest.skip("no C++ compiler: the native attention kernel is not built")


def _engine(artifact: Path) -> Any:
    return api.serve_engine(artifact, config=EngineConfig(kv=KVOptions(4, True), kv_memory_bytes=4 << 20))


def _decode_logits(engine: Any, prompts: list[list[int]], tag: str) -> torch.Tensor:
    """Each prompt prefilled in a step of its own, then ONE decode step of all of them: its logits (B, V)."""
    seqs = [Sequence(f"{tag}{i}", p, SamplingParams(max_tokens=4), order=i) for i, p in enumerate(prompts)]
    try:
        with torch.inference_mode():
            for seq in seqs:
                engine.blocks.grow(seq.seq_id, len(seq.prompt_ids) + 1)
                engine.runner.run([ScheduledChunk(seq, len(seq.prompt_ids))])
                seq.computed = len(seq.prompt_ids)
                seq.output_ids.append(5)
            return engine.runner.run([ScheduledChunk(seq, 1) for seq in seqs])  # type: ignore[no-any-return]
    finally:
        for seq in seqs:
            engine.blocks.release(seq.seq_id)


def test_a_decode_row_gets_the_same_bits_alone_or_in_a_batch_of_three(
    wide32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = serve_runner.fast_forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(serve_runner, "fast_forward", counting)
    engine = _engine(wide32_artifact)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3  # three different lengths
    alone = [_decode_logits(engine, [p], f"a{i}-")[0] for i, p in enumerate(prompts)]
    packed = _decode_logits(engine, prompts, "b-")
    assert calls, "the engine's steps should take the flat forward"
    for row, single in enumerate(alone):
        assert torch.equal(packed[row], single)


def test_the_flat_forward_gives_the_serving_step_transformers_logits(
    wide32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _engine(wide32_artifact)
    monkeypatch.setenv("SQUEEZE_FAST_PATH", "0")
    slow = _engine(wide32_artifact)
    assert fast.runner._fast and not slow.runner._fast
    prompts = [fast.tokenize(p) for p in PROMPTS]
    torch.testing.assert_close(_decode_logits(fast, prompts, "f-"), _decode_logits(slow, prompts, "s-"), atol=0, rtol=0)
