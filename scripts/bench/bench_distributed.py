"""Data-parallel compress: N torchrun ranks (gloo) vs one process, wall time of the stages and identical shards.

Runs ``python -m squeeze compress ... --json`` once in one process and once under
``python -m torch.distributed.run --standalone --nproc-per-node N -m squeeze compress ... --json`` into two
output directories, then compares every artifact file but the manifest (whose creation time differs) and prints
each run's stage timings (the JSON summary's ``timings``: sensitivity = the Fisher, quantize = k-means and
sparse parts, with "kmeans" breaking the k-means part out) and peak resident memory (/usr/bin/time: the largest
single process, i.e. one rank). Both runs use ``--threads`` torch threads per process (default 1, what torchrun
sets): GEMM and k-means results can depend on the thread count, so byte identity is checked at equal threads.

With ``--max-memory SIZE`` both runs stream block by block within that budget (per process: per rank under
torchrun), so the comparison is a bounded process against bounded ranks; the source must then be a safetensors
directory (e.g. /work/artifacts/smollm2-135m-hf), not a GGUF file.

Example: python scripts/bench/bench_distributed.py --model smollm2-135m --calibration ../shared/corpora/sotu.txt \\
         --num-samples 32 --seq-len 512 --ranks 2 --workdir /tmp/bench-dist
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, revision  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
MANIFEST = "squeeze.manifest.json"


def compress_args(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        "compress",
        args.model,
        "-o",
        str(out),
        "--recipe",
        args.recipe,
        "--calibration",
        str(args.calibration),
        "--num-samples",
        str(args.num_samples),
        "--seq-len",
        str(args.seq_len),
        "--json",
        *(["--max-memory", args.max_memory] if args.max_memory else []),
    ]


def timed_run(command: list[str], env: dict[str, str]) -> tuple[float, int | None, str]:
    """(wall seconds, peak RSS in KiB of the largest process or None, stdout); exits on failure."""
    timer = ["/usr/bin/time", "-f", "SQUEEZE_BENCH_MAXRSS_KB=%M"] if Path("/usr/bin/time").exists() else []
    start = time.perf_counter()
    run = subprocess.run([*timer, *command], capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    rss = None
    for line in run.stderr.splitlines():
        if line.startswith("SQUEEZE_BENCH_MAXRSS_KB="):
            rss = int(line.split("=", 1)[1])
    return seconds, rss, run.stdout


def summaries(stdout: str) -> list[dict[str, Any]]:
    """Every JSON document in ``stdout`` (one per rank)."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("{")
    while at >= 0:
        value, end = decoder.raw_decode(stdout, at)
        found.append(value)
        at = stdout.find("{", end)
    return found


def digests(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def stage_row(summary: dict[str, Any]) -> dict[str, float]:
    timings = summary["timings"]
    keys = ("sensitivity", "plan", "quantize", "kmeans", "sparse", "write", "seal", "checkpoint")
    return {key: round(timings[key], 2) for key in keys if key in timings} | {"seconds": round(summary["seconds"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipe", default="w4")
    parser.add_argument("--calibration", type=Path, default=SHARED / "corpora" / "sotu.txt")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-memory", default=None, help="stream within this budget per process (e.g. 2GB)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-out" / "distributed")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    one, many = args.workdir / "one", args.workdir / f"ranks{args.ranks}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(revision(), flush=True)
    print(command_line(), flush=True)

    bounded = f", --max-memory {args.max_memory}" if args.max_memory else ""
    windows = f"{args.num_samples} x {args.seq_len}"
    print(f"one process: {args.model} {args.recipe}, {windows}, {args.threads} thread(s){bounded}")
    one_seconds, one_rss, stdout = timed_run([sys.executable, "-m", "squeeze", *compress_args(args, one)], env)
    (one_summary,) = summaries(stdout)
    print(f"  {one_seconds:.1f} s wall, peak RSS {one_rss} KiB, stages {stage_row(one_summary)}", flush=True)

    print(f"{args.ranks} torchrun ranks (gloo), {args.threads} thread(s) each")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)]
    many_seconds, many_rss, stdout = timed_run([*torchrun, "-m", "squeeze", *compress_args(args, many)], env)
    ranks = summaries(stdout)
    for index, summary in enumerate(ranks):
        print(f"  a rank ({index + 1} of {len(ranks)} printed): stages {stage_row(summary)}", flush=True)
    print(f"  {many_seconds:.1f} s wall, peak RSS of the largest rank {many_rss} KiB", flush=True)

    a, b = digests(one), digests(many)
    identical = a == b
    print(f"artifact files identical (all but the manifest): {identical}")
    if not identical:
        print("  differing:", sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name)))
    result = {
        "revision": revision(),
        "command": command_line(),
        "model": args.model,
        "recipe": args.recipe,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "threads": args.threads,
        "ranks": args.ranks,
        "max_memory": args.max_memory,
        "one_process": {"wall_s": round(one_seconds, 1), "peak_rss_kib": one_rss, "stages": stage_row(one_summary)},
        "torchrun": {
            "wall_s": round(many_seconds, 1),
            "peak_rss_kib_largest_rank": many_rss,
            "stages_by_rank": [stage_row(s) for s in ranks],
        },
        "identical": identical,
        "artifact_bytes": one_summary.get("artifact_bytes"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
