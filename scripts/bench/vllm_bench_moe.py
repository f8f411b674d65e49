"""Tokens/s of a squeeze MoE artifact on vLLM vs the same model unquantized, side by side in one run (the vLLM
environment: scripts/check_vllm.sh).

    .venv-vllm/bin/python scripts/bench/vllm_bench_moe.py ARTIFACT ORIGINAL [--requests 16] [--max-tokens 64]
        [--repeats 1] [--load-format squeeze] [--tp 1]

Each engine starts in a process of its own (scripts/bench/vllm_generate.py), artifact and original alternating
``--repeats`` times; ``--requests`` greedy requests of ``--max-tokens`` new tokens each (ignore_eos) are
submitted together. Prints one JSON object: the median generate tokens/s of each, their ratio, and load
seconds. Only the ratio means anything: absolute speeds on a shared CPU move with its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "The little dog", "She looked at the", "One day, a"]


def generate(model: Path, args: argparse.Namespace, load_format: str) -> dict[str, Any]:
    """scripts/bench/vllm_generate.py's JSON result for ``model`` (RuntimeError with the log's tail if it fails)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "vllm_generate.py"), str(model), "--prompts-json"]
    cmd += [json.dumps(prompts), "--max-tokens", str(args.max_tokens), "--ignore-eos", "--dtype", args.dtype]
    cmd += ["--load-format", load_format, "--tp", str(args.tp), "--max-model-len", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT ") :])
    raise RuntimeError(f"vLLM failed on {model}:\n{(proc.stderr + proc.stdout)[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("original", type=Path, help="the unquantized model the artifact was compressed from")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--load-format", default="squeeze", help="for the artifact (Mixtral's needs squeeze)")
    args = parser.parse_args()
    speeds: dict[str, list[float]] = {"artifact": [], "original": []}
    loads: dict[str, list[float]] = {"artifact": [], "original": []}
    for _ in range(args.repeats):
        for key, model, fmt in (("artifact", args.artifact, args.load_format), ("original", args.original, "auto")):
            result = generate(model, args, fmt)
            tokens = sum(len(t) for t in result["tokens"])
            speeds[key].append(tokens / result["generate_seconds"])
            loads[key].append(result["load_seconds"])
    artifact, original = (statistics.median(speeds[k]) for k in ("artifact", "original"))
    report = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "tp": args.tp,
        "artifact_tokens_per_s": round(artifact, 1),
        "original_tokens_per_s": round(original, 1),
        "ratio": round(artifact / original, 3),
        "load_seconds": {k: round(statistics.median(v), 1) for k, v in loads.items()},
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
