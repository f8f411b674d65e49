"""Peak memory of compress, unbounded and within ``--max-memory``: peak RSS, wall time, identical bytes.

    .venv/bin/python scripts/bench/bench_memory.py --model DIR --calibration ../shared/corpora/sotu.txt \\
        --num-samples 32 --seq-len 512 --work /tmp/bench-memory

(1) ``squeeze compress`` unbounded, under ``/usr/bin/time -v`` (maximum resident set size, wall time);
(2) the same command with ``--max-memory`` = ``--fraction`` (default 0.4) of (1)'s peak, or ``--budget``;
(3) whether the artifacts are identical (every file byte for byte; the manifest but its ``created`` time and
the root digest over it). ``--unbounded-json`` reuses (1) from an earlier run's JSON. Writes JSON (--out)
and prints it. The model must be a safetensors directory (--max-memory refuses GGUF files).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MANIFEST = "squeeze.manifest.json"


def compress(args: argparse.Namespace, output: Path, max_memory: int | None) -> dict[str, Any]:
    """One ``python -m squeeze compress`` under /usr/bin/time -v: its JSON summary, peak RSS and wall time."""
    command = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "squeeze",
        "compress",
        args.model,
        "-o",
        str(output),
        "--recipe",
        args.recipe,
        "--calibration",
        args.calibration,
        "--num-samples",
        str(args.num_samples),
        "--seq-len",
        str(args.seq_len),
        "--json",
        *(["--max-memory", f"{max_memory // 10**6}MB"] if max_memory is not None else []),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    result: dict[str, Any] = {
        "command": " ".join(command[2:]),
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
        "max_memory_bytes": max_memory,
    }
    if done.returncode != 0:
        result["stderr_tail"] = done.stderr[-2000:]
        return result
    summary = json.loads(done.stdout)
    result["timings"] = summary.get("timings")
    result["seconds"] = summary.get("seconds")
    result["peak_estimate_bytes"] = summary.get("peak_estimate_bytes")
    return result


def artifact_files(directory: Path) -> dict[str, bytes]:
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    manifest = json.loads(files.pop(MANIFEST))
    files[MANIFEST] = json.dumps(
        {k: v for k, v in manifest.items() if k not in ("created", "root_digest")}, sort_keys=True
    ).encode()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a safetensors model directory")
    parser.add_argument("--recipe", default="w4")
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--fraction", type=float, default=0.4, help="budget as a share of the unbounded peak")
    parser.add_argument("--budget", type=int, default=None, help="budget in bytes (instead of --fraction)")
    parser.add_argument("--work", type=Path, required=True, help="a directory for the two artifacts")
    parser.add_argument("--unbounded-json", type=Path, default=None, help="reuse an earlier run's unbounded result")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.unbounded_json is not None:
        unbounded = json.loads(args.unbounded_json.read_text())["unbounded"]
    else:
        unbounded = compress(args, args.work / "unbounded", None)
        print(json.dumps({"unbounded": unbounded}, indent=2), flush=True)
    if unbounded.get("returncode") != 0 or not unbounded.get("peak_rss_bytes"):
        sys.exit("the unbounded run failed")
    budget = args.budget or int(unbounded["peak_rss_bytes"] * args.fraction)
    bounded = compress(args, args.work / f"bounded-{budget // 10**6}MB", budget)
    report: dict[str, Any] = {"unbounded": unbounded, "bounded": bounded, "budget_bytes": budget}
    if bounded["returncode"] == 0:
        identical = artifact_files(args.work / "unbounded") == artifact_files(
            args.work / f"bounded-{budget // 10**6}MB"
        )
        report.update(
            {
                "within_budget": bounded["peak_rss_bytes"] is not None and bounded["peak_rss_bytes"] <= budget,
                "identical": identical,
                "wall_ratio": round(bounded["wall_s"] / unbounded["wall_s"], 3),
            }
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
