"""The dtype a model computes in is decided once, at load: an artifact that keeps its embedding in float16 (as
SmolLM2's does) still computes in float32, attends through the native kernel, and gets a float32 full-precision
KV pool in squeeze serve, so its log-probabilities do not depend on the batch (reliability issue item 3,
serving-cost issue item 0)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze import api
from squeeze.eval.perplexity import token_nlls
from squeeze.runtime.attention import native_kernels
from squeeze.runtime.kernels.cpu_attention import attention_kernels
from squeeze.runtime.options import KVOptions
from squeeze.runtime.stored_dtype import compute_dtype
from squeeze.serve.engine.engine import Engine
from squeeze.serve.types import EngineConfig, RequestOutput, SamplingParams

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine."
_IDS = itertools.count()


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[RequestOutput]]:
    async def one(ids: list[int], params: SamplingParams) -> list[RequestOutput]:
        return [o async for o in engine.submit(ids, params, f"cd{next(_IDS)}")]

    async def main() -> list[list[RequestOutput]]:
        engine.start()
        try:
            return await asyncio.gather(*(one(ids, p) for ids, p in requests))
        finally:
            engine.shutdown(5)

    return asyncio.run(main())


def test_a_float16_embedding_does_not_make_the_model_compute_in_float16(half_serve_artifact: Path) -> None:
    loaded = api.load(half_serve_artifact)
    assert loaded.model.get_input_embeddings().weight.dtype == torch.float16  # kept as stored
    assert next(loaded.model.parameters()).dtype == torch.float16  # what the old rule read
    assert compute_dtype(loaded.model) == torch.float32
    if attention_kernels() is not None:
        assert native_kernels(loaded.model) is not None
    result = api.generate(loaded, "Once upon a time", max_new_tokens=2, kv_bits=16)
    assert result.kv_cache == "float32"  # squeeze run --json's report of an unquantized cache


def test_eval_names_the_full_precision_cache_by_the_compute_dtype(half_serve_artifact: Path, tmp_path: Path) -> None:
    """``squeeze eval``'s report named the 16-bit cache of a float16-embedding artifact "float16" (the first
    parameter's dtype) while it computed and cached in float32."""
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little girl who liked to play in the park. " * 20)
    result = api.evaluate(half_serve_artifact, text, seq_len=64, max_windows=2, kv_bits=16)
    assert result.kv["kv_cache"] == "float32"


def test_from_pretrained_records_the_dtype_it_loaded_in(half_serve_artifact: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(half_serve_artifact)
    assert model.get_input_embeddings().weight.dtype == torch.float16
    assert compute_dtype(model) == torch.float32


def test_the_full_precision_pool_is_float32_and_says_so(half_serve_artifact: Path) -> None:
    engine = api.serve_engine(half_serve_artifact, config=EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20))
    stats = engine.stats()
    config: Any = engine.model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    assert engine.pool.dtype == torch.float32 and stats.kv_cache == "float32"
    assert stats.kv_bytes_per_token == layers * kv_heads * head_dim * 2 * 4  # keys and values, 4 bytes each


@pytest.mark.parametrize("max_batch_tokens", [8, 256])
def test_prompt_logprobs_match_the_loaded_model_whatever_the_chunking(
    half_serve_artifact: Path, max_batch_tokens: int
) -> None:
    config = EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20, max_batch_tokens=max_batch_tokens)
    engine = api.serve_engine(half_serve_artifact, config=config)
    ids = engine.tokenize(TEXT)
    ((last,),) = _run(engine, [(ids, SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1))])
    assert last.prompt_logprobs is not None
    got = torch.tensor([e.logprob for e in last.prompt_logprobs[1:]])
    expected = -token_nlls(api.load(half_serve_artifact).model, torch.tensor([ids]))[0]
    # a float16 pool moved these by up to 5e-3 with the chunking; float32 agrees to float32 rounding
    assert torch.allclose(got, expected, atol=2e-5, rtol=0), (got - expected).abs().max()


def test_run_and_serve_attend_natively_and_agree(half_serve_artifact: Path, attend_calls: list[str]) -> None:
    calls = attend_calls
    alone = api.generate(api.load(half_serve_artifact), "Once upon a time", max_new_tokens=8, kv_bits=4)
    engine = api.serve_engine(half_serve_artifact, config=EngineConfig(kv=KVOptions(4), kv_memory_bytes=4 << 20))
    (outputs,) = _run(engine, [(engine.tokenize("Once upon a time"), SamplingParams(max_tokens=8))])
    assert calls.count("run") == calls.count("serve") == 5 * 8  # stories260K's 5 layers, 8 forwards each
    assert outputs[-1].finished and "".join(o.text for o in outputs) == alone.text
