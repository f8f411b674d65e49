"""Structured output: JSON-mode validity and throughput with and without a schema, through the serving engine.

    .venv/bin/python scripts/bench/bench_structured_output.py [--model smollm2-135m] [--requests 50]
        [--clients 16] [--max-tokens 160] [--temperature 0.7] [--name-max-length N] [--json OUT]

``--model``: an artifact directory or any model squeeze loads (the built-in ``smollm2-135m``, a GGUF or HF
checkpoint: served as loaded, without compression). ``--requests`` chat requests, seeded 0, 1, ..., with a
schema holding an enum, an integer and a nested object, ``--clients`` at a time; each reply is validated with
jsonschema. Then the same requests without a schema, each asked for exactly as many tokens as its constrained
twin produced (``ignore_eos``): output tokens/s of both, the same engine options. Also the grammar's cost: mask
fill time per step (on the worker thread, overlapped with the model) and the time to mask one logits row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import jsonschema
import torch

from squeeze.serve.engine.engine import Engine
from squeeze.serve.engine.grammar import StepMasks
from squeeze.serve.types import EngineConfig, SamplingParams, StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
        },
    },
    "required": ["color", "count", "owner"],
}
TOPICS = ["a red ball", "a small boat", "a cat named Tom", "the blue sky", "a green tree", "a toy car", "a book"]


def load_engine(model: str) -> Engine:
    from pathlib import Path

    from squeeze import api

    config = EngineConfig(kv_memory_bytes=256 << 20, max_num_seqs=16, max_model_len=1024)
    if (Path(model) / "squeeze.manifest.json").is_file():
        return api.serve_engine(model, config=config)
    from squeeze.models import load_model, resolve_model

    loaded_model, tokenizer = load_model(resolve_model(model))
    return Engine(loaded_model, tokenizer, config, None, model_name=model)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], clients: int) -> tuple[list, float]:
    async def main() -> list[Any]:
        engine.start()
        gate = asyncio.Semaphore(clients)

        async def one(i: int) -> Any:
            async with gate:
                return [o async for o in engine.submit(prompts[i], params[i], f"r{i}-{time.monotonic_ns()}")]

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    began = time.perf_counter()
    results = asyncio.run(main())
    return results, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--name-max-length", type=int, default=None, help="maxLength of the nested string")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    engine = load_engine(args.model)
    if args.name_max_length is not None:
        SCHEMA["properties"]["owner"]["properties"]["name"]["maxLength"] = args.name_max_length
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = [
        engine.tokenize_chat([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}])
        for i in range(args.requests)
    ]
    constrained = [
        SamplingParams(args.max_tokens, temperature=args.temperature, seed=i, structured=structured)
        for i in range(args.requests)
    ]
    run(engine, prompts[:2], constrained[:2], args.clients)  # warm-up (compiles the grammar, touches the model)
    results, seconds = run(engine, prompts, constrained, args.clients)
    valid, lengths, invalid = 0, [], []
    for outputs in results:
        lengths.append(sum(len(o.token_ids) for o in outputs))
        reply = "".join(o.text for o in outputs)
        try:
            jsonschema.validate(json.loads(reply), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            invalid.append({"finish_reason": outputs[-1].finish_reason, "text": reply, "error": str(exc)[:200]})
    fill_ms = 1000 * engine.masks.fill_seconds / max(1, engine.masks.fills)
    plain = [SamplingParams(n, temperature=args.temperature, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    _, plain_seconds = run(engine, prompts, plain, args.clients)

    row = torch.randn(engine.vocab_size)
    probe = StepMasks(engine.vocab_size, 1)
    probe._ready(1)
    engine.grammar.matcher(structured).fill_next_token_bitmask(probe.bitmask, 0)
    began = time.perf_counter()
    for _ in range(200):
        probe.masked(0, row)
    apply_ms = 1000 * (time.perf_counter() - began) / 200
    probe.close()
    engine.shutdown(5)

    report = {
        "model": args.model,
        "schema": SCHEMA,
        "requests": args.requests,
        "clients": args.clients,
        "temperature": args.temperature,
        "schema_valid": valid,
        "invalid": invalid,
        "mean_tokens": sum(lengths) / len(lengths),
        "tokens_per_s_schema": sum(lengths) / seconds,
        "tokens_per_s_plain": sum(lengths) / plain_seconds,
        "mask_fill_ms_per_step": fill_ms,
        "mask_apply_ms_per_row": apply_ms,
        "vocab": engine.vocab_size,
    }
    report["throughput_ratio"] = report["tokens_per_s_schema"] / report["tokens_per_s_plain"]
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
