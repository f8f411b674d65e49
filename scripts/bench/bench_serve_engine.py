"""Serving benchmark: continuous batching vs static batches vs one request at a time, KV capacity, latencies.

    .venv/bin/python scripts/bench/bench_serve_engine.py [--artifact DIR ...] [--clients 1,4,16,32]
        [--requests-per-client 2] [--prompt-tokens 16:256] [--output-tokens 16:128] [--kv-memory 256MiB] [--repeats 1]
        [--capacity-len 1024] [--capacity-memory 1GiB] [--max-model-len 2048] [--one-at-a-time-at 16]
        [--invariance-tokens 48] [--skip-fp] [--threads N] [--seed 0] [--json OUT]

Default artifacts: artifacts/smollm2-135m-w4-kv4 and artifacts/smollm2-135m-w4-kv8 (SmolLM2-135M w4 with
int4 / int8 KV calibrated by ``squeeze calibrate-kv``); each runs with its calibrated cache, and the first
also with the full-precision paged cache (``--kv-bits 16``).

Everything runs in this process, through the engine squeeze serve runs (squeeze.serve.engine.engine), without HTTP:
clients are coroutines on an event loop in a second thread, the engine runs in the main thread (as in
squeeze serve). The workload is fixed by ``--seed``: ``clients x --requests-per-client`` requests,
prompt lengths and output lengths drawn uniformly from the ranges given (prompts are windows of sotu.txt;
greedy, ``ignore_eos`` so every request produces exactly its output length).

(a) Throughput, output tokens/s over the whole workload, at each client count, modes interleaved over
    ``--repeats`` (medians; one untimed warm-up run first), a fresh engine on the same loaded model per run:
    - continuous: each client sends its next request as soon as its previous one finished; requests join and
      leave the running batch between steps.
    - static: the requests in batches of ``clients``; a batch starts when the previous one has fully finished.
    - one at a time: the same requests sent by one client (at the client counts of ``--one-at-a-time-at``).
    Goals (issue 14): continuous >= 1.2x static at 16 clients (moonshot 2x), >= 4x one at a time.
(b) Capacity: how many concurrent sequences fit in ``--capacity-memory``, paged (int4, int8, fp16 blocks
    of 16 tokens, plus each sequence's fp16 sink entry) vs a contiguous reservation of ``--max-model-len``
    tokens per sequence: lengths fixed at ``--capacity-len``, uniform in [64, max-model-len], or the
    workload's prompt + output lengths, each placed through the engine's block manager. Goals: int4 paged
    >= 3.5x fp16 paged; paged >= 2x contiguous when lengths vary.
(c) Fragmentation: the engine's KV block utilisation during the continuous run at 16 clients (share of the
    token slots in allocated blocks that hold live tokens, averaged over steps). Goal >= 90 %.
(d) Time to first token and inter-token latency, p50 / p99, of the continuous and the static runs.
(e) Batch invariance: 16 prompts sent at once (greedy, ``--invariance-tokens`` new tokens) against
    ``squeeze.api.generate`` of each prompt alone (what ``squeeze run`` does): how many texts are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ARTIFACTS = [REPO / "artifacts" / "smollm2-135m-w4-kv4", REPO / "artifacts" / "smollm2-135m-w4-kv8"]
TEXT = REPO.parent / "shared" / "corpora" / "sotu.txt"


class Latencies:
    """A LatencyObserver that keeps every sample."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.append(seconds)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def workload(tokenizer: Any, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int):
    """``count`` (prompt ids, output tokens) pairs: windows of sotu.txt, lengths uniform in the ranges."""
    ids = tokenizer(TEXT.read_text(encoding="utf-8")[:400_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - length)
        requests.append((ids[start : start + length], rng.randint(*output_range)))
    return requests


async def _one(engine: Any, prompt: list[int], tokens: int, request_id: str) -> int:
    from squeeze.serve.types import SamplingParams

    handle = engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), request_id)
    last = None
    async for output in handle:
        last = output
    assert last is not None and last.finish_reason == "length", last
    return last.completion_tokens


async def run_continuous(engine: Any, requests: list, clients: int) -> float:
    """Closed loop: each client sends the next request of the shared list as soon as its last one finished."""
    queue = list(enumerate(requests))
    produced = 0

    async def client() -> None:
        nonlocal produced
        while queue:
            index, (prompt, tokens) = queue.pop(0)
            done = await _one(engine, prompt, tokens, f"c{index}")
            produced += done  # not `produced += await ...`: that reads `produced` before the await

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return produced / (time.perf_counter() - start)


async def run_static(engine: Any, requests: list, clients: int) -> float:
    """Batches of ``clients`` requests, each started only when the previous batch has finished."""
    produced = 0
    start = time.perf_counter()
    for first in range(0, len(requests), clients):
        batch = requests[first : first + clients]
        done = await asyncio.gather(*(_one(engine, p, n, f"s{first + i}") for i, (p, n) in enumerate(batch)))
        produced += sum(done)
    return produced / (time.perf_counter() - start)


def drive(engine: Any, clients: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``clients()`` on an event loop in a second thread while the engine runs in this one, as squeeze
    serve runs them (the engine steps fastest in the thread that loaded the model: Engine.run); its result."""
    result: dict[str, Any] = {}

    def client_side() -> None:
        try:
            result["value"] = asyncio.run(clients())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            result["error"] = exc
        finally:
            engine.shutdown(5)

    engine.claim_loop()
    thread = threading.Thread(target=client_side, name="bench-clients")
    thread.start()
    engine.run(until=lambda: not thread.is_alive())
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _measure(engine: Any, runner: Any, requests: list, clients: int) -> float:
    return float(drive(engine, lambda: runner(engine, requests, clients)))


def make_engine(loaded: Any, kv_spec: Any, args: argparse.Namespace, observer: Latencies | None = None) -> Any:
    from squeeze.config import parse_size
    from squeeze.serve.engine.engine import Engine
    from squeeze.serve.types import EngineConfig

    config = EngineConfig(
        kv_memory_bytes=parse_size(args.kv_memory),
        max_num_seqs=max(args.clients),
        max_batch_tokens=args.max_batch_tokens,
        max_model_len=args.max_model_len,
    )
    engine = Engine(loaded.model, loaded.tokenizer, config, kv_spec, model_name="bench")
    engine.observer = observer
    return engine


def warm_up(loaded: Any, kv_spec: Any, args: argparse.Namespace) -> None:
    """One short untimed run: the first steps of a process pay for thread pools and first-call set-up."""
    requests = workload(loaded.tokenizer, 4, (16, 64), (8, 8), args.seed)
    _measure(make_engine(loaded, kv_spec, args), run_continuous, requests, 4)


def throughput(loaded: Any, kv_spec: Any, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Continuous vs static at every client count; modes interleaved over ``--repeats``, medians reported."""
    warm_up(loaded, kv_spec, args)
    rows: dict[str, Any] = {}
    for clients in args.clients:
        requests = workload(
            loaded.tokenizer,
            clients * args.requests_per_client,
            args.prompt_tokens,
            args.output_tokens,
            args.seed + clients,
        )
        observers = {"continuous": Latencies(), "static": Latencies()}
        result: dict[str, Any] = {"requests": len(requests), "output_tokens": sum(n for _, n in requests)}
        samples: dict[str, list[float]] = {"continuous": [], "static": [], "one_at_a_time": []}
        modes = [("continuous", run_continuous, clients), ("static", run_static, clients)]
        if clients in args.one_at_a_time_at:
            modes.append(("one_at_a_time", run_continuous, 1))
        for _ in range(args.repeats):
            for mode, runner, concurrency in modes:
                if mode != "continuous" and clients == 1:
                    continue  # one client: static and one at a time are the continuous schedule
                engine = make_engine(loaded, kv_spec, args, observers.get(mode))
                samples[mode].append(_measure(engine, runner, requests, concurrency))
                stats = engine.stats()
                assert stats.kv_blocks_free == stats.kv_blocks_total, stats  # every block back after the run
                if mode == "continuous":
                    result.setdefault("kv_block_utilisation_runs", []).append(stats.kv_block_utilisation)
                    result["preemptions"] = result.get("preemptions", 0) + stats.preemptions_total
        for mode, values in samples.items():
            if values:
                result[mode] = statistics.median(values)
                result[f"{mode}_runs"] = values
        result["kv_block_utilisation"] = statistics.mean(result["kv_block_utilisation_runs"])
        for mode, observer in observers.items():
            if observer.ttft and observer.itl:
                prefix = "" if mode == "continuous" else "static_"
                result[f"{prefix}ttft_p50"] = percentile(observer.ttft, 50)
                result[f"{prefix}ttft_p99"] = percentile(observer.ttft, 99)
                result[f"{prefix}itl_p50"] = percentile(observer.itl, 50)
                result[f"{prefix}itl_p99"] = percentile(observer.itl, 99)
        rows[str(clients)] = result
        static = f"{result['static']:.1f}" if "static" in result else "-"
        print(
            f"  [{label}] {clients:>2} clients: continuous {result['continuous']:.1f} tok/s, static {static} tok/s,"
            f" block utilisation {result['kv_block_utilisation']:.3f}",
            flush=True,
        )
    for result in rows.values():
        if "one_at_a_time" in result:
            result["continuous_vs_one_at_a_time"] = result["continuous"] / result["one_at_a_time"]
        if "static" in result:
            result["continuous_vs_static"] = result["continuous"] / result["static"]
    return rows


INVARIANCE_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Here is a recipe for tomato soup:",
    "In 1905, a young patent clerk",
    "The three primary colours are",
    "Write a haiku about the sea.",
    "Water boils at",
    "The largest planet in the solar system",
    "My favourite book is",
    "To install the package, run",
    "The stock market today",
    "Photosynthesis is the process",
    "A good night's sleep",
    "The history of the Roman Empire",
]


def invariance(loaded: Any, kv_spec: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Texts of 16 concurrent requests vs each prompt alone through api.generate (squeeze run's path)."""
    from squeeze import api
    from squeeze.serve.types import SamplingParams

    engine = make_engine(loaded, kv_spec, args)

    params = SamplingParams(max_tokens=args.invariance_tokens)

    async def one(i: int, prompt: str) -> str:
        handle = engine.submit(engine.tokenize(prompt), params, f"i{i}")
        return "".join([output.text async for output in handle])

    async def together() -> list[str]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(INVARIANCE_PROMPTS))))

    served = drive(engine, together)
    bits = kv_spec.bits if kv_spec is not None else 16
    alone = [
        api.generate(loaded, p, max_new_tokens=args.invariance_tokens, kv_bits=bits).text for p in INVARIANCE_PROMPTS
    ]
    differing = [i for i, (a, b) in enumerate(zip(served, alone, strict=True)) if a != b]
    return {"prompts": len(alone), "identical": len(alone) - len(differing), "differing": differing}


def capacity(loaded: Any, specs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Sequences that fit in ``--kv-memory``: paged at each width vs a contiguous reservation of max-model-len
    tokens each. A paged sequence costs its blocks plus its sink entry (quantized caches keep 4 tokens in
    fp16); lengths fixed at ``--capacity-len``, or drawn uniformly from [64, max-model-len], or the benchmark's
    own request lengths (prompt + output), each sequence placed through the engine's block manager."""
    import torch

    from squeeze.config import parse_size
    from squeeze.quant.kv_bytes import kv_geometry
    from squeeze.serve.engine.blocks import BlockManager
    from squeeze.serve.engine.kv_pool import AttentionShape, block_bytes, sink_bytes

    memory = parse_size(args.capacity_memory)
    shape = AttentionShape(*kv_geometry(loaded.model.config))
    block = 16
    rng = random.Random(args.seed)
    distributions = {
        "fixed": [args.capacity_len] * 100_000,
        "uniform": [rng.randint(64, args.max_model_len) for _ in range(100_000)],
        "workload": [rng.randint(*args.prompt_tokens) + rng.randint(*args.output_tokens) for _ in range(100_000)],
    }
    out: dict[str, Any] = {"kv_memory_bytes": memory, "max_model_len": args.max_model_len, "widths": {}}
    for width, spec in specs.items():
        per_block = block_bytes(spec, shape, block, torch.float16)
        per_sink = sink_bytes(spec, shape, 1, torch.float16)
        row: dict[str, Any] = {"bytes_per_token": per_block // block, "sink_bytes_per_sequence": per_sink}
        row["contiguous"] = memory // (args.max_model_len * (per_block // block) + per_sink)
        for name, lengths in distributions.items():
            manager = BlockManager(memory // per_block, block, 0)
            fitted = 0
            for length in lengths:  # place sequences until one no longer fits (its blocks and its sink entry)
                room = memory - (fitted + 1) * per_sink
                if room < (manager.num_blocks - manager.free_blocks + manager.blocks_for(length)) * per_block:
                    break
                manager.grow(f"q{fitted}", length)
                fitted += 1
            row[f"paged_{name}"] = fitted
        out["widths"][width] = row
    fp16 = out["widths"]["fp16"]["paged_fixed"]
    for row in out["widths"].values():
        row["paged_fixed_vs_fp16_paged"] = row["paged_fixed"] / fp16
        for name in distributions:
            row[f"paged_{name}_vs_contiguous"] = row[f"paged_{name}"] / max(1, row["contiguous"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, action="append")
    parser.add_argument("--clients", default="1,4,16,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", default="16:256")
    parser.add_argument("--output-tokens", default="16:128")
    parser.add_argument("--kv-memory", default="256MiB")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--capacity-len", type=int, default=1024)
    parser.add_argument("--capacity-memory", default="1GiB")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--invariance-tokens", type=int, default=48)
    parser.add_argument(
        "--one-at-a-time-at", default="16", help="client counts whose workload also runs one request at a time"
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-fp", action="store_true", help="skip the full-precision paged cache run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    args.one_at_a_time_at = {int(c) for c in args.one_at_a_time_at.split(",") if c}
    args.prompt_tokens = tuple(int(v) for v in args.prompt_tokens.split(":"))
    args.output_tokens = tuple(int(v) for v in args.output_tokens.split(":"))

    import torch

    from squeeze import api
    from squeeze.quant.kv_spec import KVSpec
    from squeeze.runtime.kv_selection import kv_spec_for

    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command_line(),
        "revision": revision(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, python {sys.version.split()[0]}",
        "workload": {
            "clients": args.clients,
            "requests_per_client": args.requests_per_client,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "kv_memory": args.kv_memory,
            "max_batch_tokens": args.max_batch_tokens,
        },
        "runs": {},
    }
    print(report["revision"], "\n", report["machine"], flush=True)
    specs: dict[str, Any] = {"fp16": None}
    first = True
    for artifact in args.artifact or DEFAULT_ARTIFACTS:
        loaded = api.load(artifact)
        spec = kv_spec_for(loaded.model, loaded.kv_spec, None)
        label = f"{artifact.name} kv {'int' + str(spec.bits) if spec else 'fp'}"
        print(f"{label}:", flush=True)
        report["runs"][label] = throughput(loaded, spec, args, label)
        report.setdefault("invariance", {})[label] = invariance(loaded, spec, args)
        print(f"  batch invariance: {report['invariance'][label]}", flush=True)
        if spec is not None:
            specs[f"int{spec.bits}"] = spec
        if first and not args.skip_fp:
            label = f"{artifact.name} kv fp32 (paged, full precision)"
            print(f"{label}:", flush=True)
            report["runs"][label] = throughput(loaded, None, args, label)
        if first:
            names = loaded.kv_spec.names if loaded.kv_spec is not None else ()
            specs.setdefault("int4", KVSpec.dynamic(4, names))
            specs.setdefault("int8", KVSpec.dynamic(8, names))
            capacity_model = loaded
        first = False
    report["capacity"] = capacity(capacity_model, specs, args)
    print(json.dumps(report["capacity"], indent=1))
    for label, rows in report["runs"].items():
        for clients, row in rows.items():
            vs_static = row.get("continuous_vs_static")
            line = f"{label:<45} {clients:>3} clients  continuous {row['continuous']:7.1f} tok/s"
            if vs_static:
                line += f"  vs static {vs_static:.2f}x"
            if "continuous_vs_one_at_a_time" in row:
                line += f"  vs one at a time {row['continuous_vs_one_at_a_time']:.2f}x"
            if "ttft_p50" in row:
                line += f"  ttft p50/p99 {row['ttft_p50'] * 1e3:.0f}/{row['ttft_p99'] * 1e3:.0f} ms"
                line += f"  itl p50/p99 {row['itl_p50'] * 1e3:.0f}/{row['itl_p99'] * 1e3:.0f} ms"
            if "static_ttft_p50" in row:
                p50, p99 = row["static_ttft_p50"] * 1e3, row["static_ttft_p99"] * 1e3
                line += f"  static ttft p50/p99 {p50:.0f}/{p99:.0f} ms"
            print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
