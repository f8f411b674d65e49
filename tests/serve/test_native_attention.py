"""squeeze serve and squeeze run attend a quantized KV cache through the same native kernel (and give the same
text); a 16-bit cache stays on SDPA in both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from squeeze import api
from squeeze.runtime.options import KVOptions
from squeeze.serve.types import EngineConfig, SamplingParams


def _served(artifact: Path, prompt: str, kv_bits: int) -> str:
    engine = api.serve_engine(artifact, config=EngineConfig(kv=KVOptions(kv_bits), kv_memory_bytes=4 << 20))

    async def main() -> str:
        engine.start()
        try:
            handle = engine.submit(engine.tokenize(prompt), SamplingParams(max_tokens=8), "r0")
            return "".join([o.text async for o in handle])
        finally:
            engine.shutdown(5)

    return asyncio.run(main())


@pytest.mark.parametrize("kv_bits", [4, 16])
def test_run_and_serve_use_the_native_kernel_for_a_quantized_cache(
    serve_artifact: Path, kv_bits: int, attend_calls: list[str]
) -> None:
    calls = attend_calls
    prompt = "Once upon a time"
    alone = api.generate(api.load(serve_artifact), prompt, max_new_tokens=8, kv_bits=kv_bits)
    served = _served(serve_artifact, prompt, kv_bits)
    assert served == alone.text
    layers = 5  # stories260K; one call per layer and forward
    if kv_bits == 16:
        assert calls == []
    else:
        assert calls.count("run") == calls.count("serve") == layers * 8  # a prefill and 7 decode steps each
