"""Verify throughput on a ~1 GB artifact against `sha256sum` over the same files, in the same run.

    .venv/bin/python scripts/bench_verify.py [--size-mb 1024] [--repeats 3] [--out bench-out/verify.json]

Both read from a warm page cache (one untimed warm-up pass each). Prints a table and the ratio
squeeze / sha256sum of throughputs (higher is better for squeeze); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from squeeze import verify_model_integrity
from squeeze.format import Provenance, seal_artifact, write_shards


def build(directory: Path, size_mb: int) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    per_tensor = 64 * 2**20
    tensors = {}
    for i in range(max(1, size_mb * 2**20 // per_tensor)):
        tensors[f"layer{i}.weight"] = torch.randint(0, 255, (per_tensor,), dtype=torch.uint8, generator=generator)
    write_shards(directory, tensors, max_shard_bytes=256 * 2**20)
    seal_artifact(directory, Provenance(source_model="bench"))
    return sorted(p.name for p in directory.iterdir() if p.name != "squeeze.manifest.json")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-out/verify.json")
    parser.add_argument("--dir", default=None, help="where to build the artifact (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="squeeze-bench-verify-"))
    directory = root / "artifact"
    try:
        files = build(directory, args.size_mb)
        total = sum((directory / f).stat().st_size for f in files)

        def ours() -> None:
            if not verify_model_integrity(directory).ok:
                raise SystemExit("verify failed on a fresh artifact")

        def theirs() -> None:
            subprocess.run(["sha256sum", *files], cwd=directory, check=True, stdout=subprocess.DEVNULL)

        def theirs_parallel() -> None:  # one sha256sum per file, all at once: the fair parallel peer
            procs = [subprocess.Popen(["sha256sum", f], cwd=directory, stdout=subprocess.DEVNULL) for f in files]
            if any(p.wait() for p in procs):
                raise SystemExit("sha256sum failed")

        results = {}
        for name, fn in (
            ("squeeze verify", ours),
            ("sha256sum", theirs),
            ("sha256sum x N (parallel)", theirs_parallel),
        ):
            fn()  # warm-up: page cache and imports
            times = [timed(fn) for _ in range(args.repeats)]
            results[name] = statistics.median(times)
        rows = []
        print(f"artifact: {len(files)} files, {total / 1e9:.3f} GB, {os.cpu_count()} CPUs, median of {args.repeats}")
        print(f"{'tool':28s} {'seconds':>8s} {'MB/s':>8s} {'squeeze speed / this':>22s}")
        for name, seconds in results.items():
            ratio = seconds / results["squeeze verify"]
            rows.append({"tool": name, "seconds": seconds, "mb_per_s": total / seconds / 1e6, "squeeze_speedup": ratio})
            print(f"{name:28s} {seconds:8.3f} {total / seconds / 1e6:8.0f} {ratio:22.2f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bytes": total, "files": len(files), "results": rows}, indent=2))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
