"""Checkpoint overhead, and an interrupted-and-resumed compress against an uninterrupted one.

    .venv/bin/python scripts/bench/bench_resume.py                  # SmolLM2-135M, w4, sotu 8 x 256 tokens
    .venv/bin/python scripts/bench/bench_resume.py --num-samples 32 --seq-len 512   # the main job's calibration

Each run is a real ``squeeze compress`` subprocess. (1) Uninterrupted: wall time, and the seconds the run
spent writing and reading checkpoints (its ``checkpoint`` stage: Fisher and layer-group saves, group reads
at assembly) as a share of the run's own time. (2) The same command, sent SIGTERM once ``--interrupt-after``
layer groups are committed, then rerun with ``--resume``: wall time of both parts against (1), and whether
the artifacts are byte-identical (every file but the manifest, whose ``created`` time differs; the
manifest's root digest covers all the others). Writes JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
CLI = [sys.executable, "-c", "from squeeze.cli.app import main; main()"]


def compress_args(args: argparse.Namespace, output: Path) -> list[str]:
    return [
        *CLI,
        "compress",
        args.model,
        "-o",
        str(output),
        "--recipe",
        args.recipe,
        "--calibration",
        str(args.calibration),
        "--num-samples",
        str(args.num_samples),
        "--seq-len",
        str(args.seq_len),
        "--json",
    ]


def run_to_end(command: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"compress failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def run_interrupted(command: list[str], output: Path, after_groups: int) -> tuple[float, int, str]:
    """Start ``command``, SIGTERM it once ``after_groups`` layer-group checkpoints exist; (seconds, rc, stderr)."""
    groups = output / ".squeeze-work" / "groups"
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    while proc.poll() is None:
        if groups.is_dir() and sum(1 for p in groups.iterdir() if not p.name.startswith(".")) >= after_groups:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, stderr = proc.communicate()
    return time.perf_counter() - start, proc.returncode, stderr


def files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "squeeze.manifest.json"
    }


def manifest_content(directory: Path) -> dict:
    """The manifest less its creation time and root digest (v2's digest covers the time, which differs)."""
    data = json.loads((directory / "squeeze.manifest.json").read_text())
    return {key: value for key, value in data.items() if key not in ("created", "root_digest")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipe", default="w4")
    parser.add_argument("--calibration", type=Path, default=SHARED / "corpora" / "sotu.txt")
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--interrupt-after", type=int, default=15, help="layer groups committed before SIGTERM")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-out" / "resume")
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "bench_resume.json")
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    plain, resumed = args.workdir / "plain", args.workdir / "resumed"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    print(f"uninterrupted: {args.model} {args.recipe}, calibration {args.num_samples} x {args.seq_len}", flush=True)
    plain_seconds, plain_summary = run_to_end(compress_args(args, plain))
    checkpoint = plain_summary["timings"].get("checkpoint", 0.0)
    print(f"  {plain_seconds:.1f} s wall, checkpoint stage {checkpoint:.2f} s", flush=True)

    print(f"interrupted after {args.interrupt_after} layer groups, then --resume", flush=True)
    first_seconds, rc, stderr = run_interrupted(compress_args(args, resumed), resumed, args.interrupt_after)
    if rc != 143:
        sys.exit(f"expected exit 143 after SIGTERM, got {rc}:\n{stderr[-3000:]}")
    second_seconds, resumed_summary = run_to_end(compress_args(args, resumed) + ["--resume"])
    identical = files(plain) == files(resumed) and manifest_content(plain) == manifest_content(resumed)

    result = {
        "model": args.model,
        "recipe": args.recipe,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "interrupt_after_groups": args.interrupt_after,
        "uninterrupted_wall_s": round(plain_seconds, 2),
        "uninterrupted_run_s": plain_summary["seconds"],
        "uninterrupted_timings": plain_summary["timings"],
        "checkpoint_s": checkpoint,
        "checkpoint_share": round(checkpoint / plain_summary["seconds"], 4),
        "interrupted_part_wall_s": round(first_seconds, 2),
        "resumed_part_wall_s": round(second_seconds, 2),
        "resumed_timings": resumed_summary["timings"],
        "interrupted_plus_resumed_wall_s": round(first_seconds + second_seconds, 2),
        "byte_identical": identical,
        "root_digest": resumed_summary["root_digest"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print("| measure | result |")
    print("|---|---|")
    print(f"| uninterrupted compress (wall) | {plain_seconds:.1f} s |")
    print(
        f"| checkpoint stage (Fisher and every layer group written, groups read back) "
        f"| {checkpoint:.2f} s = {100 * result['checkpoint_share']:.2f}% of the run |"
    )
    print(
        f"| interrupted run (SIGTERM after {args.interrupt_after} groups) + resumed run | "
        f"{first_seconds:.1f} s + {second_seconds:.1f} s = {first_seconds + second_seconds:.1f} s "
        f"({(first_seconds + second_seconds) / plain_seconds:.2f}x) |"
    )
    print(f"| artifacts byte-identical | {identical} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
