"""Speculative decoding in ``squeeze serve``: tokens/s with each drafter against ``--speculate off``, same box, one run.

    python scripts/bench/bench_speculation.py ARTIFACT [--modes off,ngram:12,int8:3]
        [--corpus ../shared/corpora/sotu.txt] [--requests 4] [--output-tokens 128] [--load-clients 16]
        [--load-requests 32] [--server-arg=--kv-bits=4] [--json OUT]

For each mode a ``squeeze serve --speculate MODE`` is started (scripts/bench/bench_serve.py's Server), and the
same requests are sent, greedy, over streamed /v1/completions:

- ``sotu``: ``--requests`` windows of the corpus (64-256 tokens), ``--output-tokens`` new tokens each
  (``ignore_eos``), one client: free continuation of a speech;
- ``summary``: ``--requests`` chat-templated requests "Summarize the following text" over a 300-token window
  of the corpus (stopping at the model's end of turn, at most ``--output-tokens``), one client: an output that
  copies its prompt;
- ``load``: ``--load-requests`` windows from ``--load-clients`` closed-loop clients (speculation is turned
  down or off per step when rows are many: this checks it never costs throughput under load).

Reported per mode and workload: output tokens/s (all output tokens over the point's wall time), the decode rate
(tokens after the first over the time after the first token, summed over requests), the ratio to ``off``, the
drafts' acceptance from /metrics (squeeze_spec_accepted_tokens_total / squeeze_spec_draft_tokens_total), and
whether every request's text equals the text ``off`` produced (speculation never changes greedy output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs
from bench_serve import Server, squeeze_server, windows


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


@dataclass
class Done:
    text: str = ""
    tokens: int = 0
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    error: str = ""
    pieces: list[str] = field(default_factory=list)


async def one(client: httpx.AsyncClient, base: str, model: str, job: Job) -> Done:
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": job.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    done = Done(start=time.perf_counter())
    async with client.stream("POST", f"{base}/completions", json=body) as response:
        if response.status_code != 200:
            done.error = f"HTTP {response.status_code}"
            return done
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage") and not event.get("choices"):
                done.tokens = int(event["usage"]["completion_tokens"])
                continue
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    done.first = done.first or time.perf_counter()
                    done.pieces.append(choice["text"])
    done.end = time.perf_counter()
    done.text = "".join(done.pieces)
    return done


async def drive(base: str, jobs: list[Job], clients: int) -> tuple[list[Done], float]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        model = (await client.get(f"{base}/models")).json()["data"][0]["id"]
        results: list[Done | None] = [None] * len(jobs)
        queue = list(range(len(jobs)))[::-1]
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                index = queue.pop()
                results[index] = await one(client, base, model, jobs[index])

        await asyncio.gather(*(worker() for _ in range(clients)))
        return [r for r in results if r is not None], time.perf_counter() - start


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[Job], int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.artifact)
    corpus = tokenizer(args.corpus.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    rng = random.Random(args.seed)
    sotu = [Job(p, args.output_tokens, True) for p in windows(corpus, args.requests, (64, 256), rng)]
    summary = []
    for excerpt in windows(corpus, args.requests, (300, 300), rng):
        text = "Summarize the following text in a few sentences.\n\n" + tokenizer.decode(excerpt)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        summary.append(Job(list(ids), args.output_tokens, False))
    load = [Job(p, args.output_tokens, True) for p in windows(corpus, args.load_requests, (64, 256), rng)]
    return {"sotu": (sotu, 1), "summary": (summary, 1), "load": (load, args.load_clients)}


def run_mode(args: argparse.Namespace, mode: str, work: dict[str, tuple[list[Job], int]]) -> dict[str, Any]:
    server: Server = squeeze_server(args, f"squeeze --speculate {mode}", ["--speculate", mode])
    base = server.start()
    out: dict[str, Any] = {}
    try:
        for name, (jobs, clients) in work.items():
            before = server.metrics()
            done, wall = asyncio.run(drive(base, jobs, clients))
            after = server.metrics()
            drafted = after.get("squeeze_spec_draft_tokens_total", 0.0) - before.get(
                "squeeze_spec_draft_tokens_total", 0.0
            )
            kept = after.get("squeeze_spec_accepted_tokens_total", 0.0) - before.get(
                "squeeze_spec_accepted_tokens_total", 0.0
            )
            tokens = sum(d.tokens for d in done)
            decode_time = sum(d.end - d.first for d in done if d.first is not None)
            out[name] = {
                "tokens": tokens,
                "seconds": wall,
                "tokens_per_second": tokens / wall,
                "decode_tokens_per_second": sum(max(0, d.tokens - 1) for d in done) / decode_time
                if decode_time
                else 0.0,
                "drafted": drafted,
                "accepted": kept,
                "acceptance": kept / drafted if drafted else None,
                "errors": [d.error for d in done if d.error],
                "texts": [d.text for d in done],
            }
            row = out[name]
            rate = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            speed, decode = row["tokens_per_second"], row["decode_tokens_per_second"]
            print(
                f"{mode:>10} {name:>8}: {speed:7.1f} tok/s, decode {decode:6.1f} tok/s, {tokens} tokens in "
                f"{wall:.1f} s, drafts accepted {rate} ({kept:.0f}/{drafted:.0f})",
                flush=True,
            )
    finally:
        server.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--modes", default="off,ngram:12,int8:3")
    parser.add_argument("--corpus", type=Path, default=Path("../shared/corpora/sotu.txt"))
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--load-clients", type=int, default=16)
    parser.add_argument("--load-requests", type=int, default=32)
    parser.add_argument("--kv-memory", default="256MiB")
    parser.add_argument("--server-arg", action="append", default=[], help="extra squeeze serve argument")
    parser.add_argument("--omp-wait-policy", default=None)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if modes[0] != "off":
        modes.insert(0, "off")
    work = workloads(args)
    load_before = os.getloadavg()
    results = {mode: run_mode(args, mode, work) for mode in modes}
    base = results["off"]
    print("\nratio to --speculate off (tokens/s; decode rate), same text as off:")
    table = []
    for mode in modes[1:]:
        for name in work:
            row, ref = results[mode][name], base[name]
            same = row["texts"] == ref["texts"]
            ratio = row["tokens_per_second"] / ref["tokens_per_second"]
            decode = (
                row["decode_tokens_per_second"] / ref["decode_tokens_per_second"]
                if ref["decode_tokens_per_second"]
                else 0.0
            )
            rate = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            table.append({"mode": mode, "workload": name, "ratio": ratio, "decode_ratio": decode, "same_text": same})
            print(f"  {mode:>10} {name:>8}: {ratio:.2f}x ({decode:.2f}x decode), accepted {rate}, same text: {same}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": command_line(),
                    "revision": revision(),
                    "load_average_before": load_before,
                    "load_average_after": os.getloadavg(),
                    "results": results,
                    "ratios": table,
                },
                indent=1,
            )
        )
    return 0 if all(r["same_text"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
