"""Peak resident memory of a bounded (``--max-memory``) compress of a tiny MoE at 16, 64 and 256 experts per layer.

Builds three random Qwen3-MoE models that differ only in ``num_experts`` (the stories260K tokenizer, hidden 128,
two layers, moe_intermediate_size 64, two experts per token, saved in bfloat16), compresses each with the same
recipe, calibration and budget (``python -m squeeze compress ... --max-memory BUDGET --json``, one process or
``--ranks N`` torchrun ranks), and prints, per model, the peak RSS of the largest process (/usr/bin/time),
preflight's peak estimate, the expert group size the run chose and the wall time, side by side in one run; with
``--compare`` (the default) each model is also compressed without ``--max-memory`` and the two artifacts are
compared file by file (the manifest but its creation time). Issue 48 asks for the peak to be flat in the number of
experts (one expert group resident, not the whole block): the ratio 256 / 16 printed last says how far it is.

Example: python scripts/bench/bench_moe_memory.py --budget 650MB --workdir /tmp/bench-moe [--ranks 2]
"""

from __future__ import annotations

import argparse
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


def save_moe(root: Path, experts: int, hidden: int, moe_inter: int, tokenizer_dir: Path) -> Path:
    """A random Qwen3-MoE with ``experts`` routed experts per layer, saved in bfloat16 with its tokenizer."""
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = tf.Qwen3MoeConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        vocab_size=len(tokenizer),
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.to(torch.bfloat16).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def compress(
    args: argparse.Namespace, source: Path, out: Path, bounded: bool = True
) -> tuple[float, int | None, dict[str, Any]]:
    """(wall seconds, peak RSS KiB of the largest process, rank 0's JSON summary); exits on failure.
    ``bounded``: with ``--max-memory`` (else one unbounded process, the reference bytes)."""
    squeeze = [
        "compress",
        str(source),
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
        *(["--max-memory", args.budget] if bounded else []),
        "--json",
    ]
    launcher = [sys.executable, "-m", "squeeze"]
    if args.ranks > 1 and bounded:
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)]
        launcher = [*run, "-m", "squeeze"]
    timer = ["/usr/bin/time", "-f", "SQUEEZE_BENCH_MAXRSS_KB=%M"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run([*timer, *launcher, *squeeze], capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"compress of {source} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rss = next((int(line.split("=", 1)[1]) for line in done.stderr.splitlines() if "MAXRSS_KB=" in line), None)
    summary = json.JSONDecoder().raw_decode(done.stdout, done.stdout.find("{"))[0]
    return seconds, rss, summary


def same_artifact(got: Path, want: Path) -> bool:
    """Every file byte for byte; the manifest but its ``created`` time and ``root_digest``."""
    files = sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(want) for p in want.rglob("*") if p.is_file()):
        return False
    for name in files:
        a, b = (got / name).read_bytes(), (want / name).read_bytes()
        if name.name == "squeeze.manifest.json":
            a_json, b_json = json.loads(a), json.loads(b)
            for data in (a_json, b_json):  # the creation time, and the root digest over it, differ in any two runs
                data.pop("created", None)
                data.pop("root_digest", None)
            if a_json != b_json:
                return False
        elif a != b:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--moe-intermediate", type=int, default=64)
    parser.add_argument("--recipe", default="w4")
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "models" / "stories260K")
    parser.add_argument("--calibration", type=Path, default=SHARED / "corpora" / "tinystories_sample.txt")
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--budget", default="650MB", help="the same --max-memory for every model")
    parser.add_argument("--no-compare", dest="compare", action="store_false", help="skip the unbounded runs")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-out" / "moe-memory")
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    print(revision(), flush=True)
    print(command_line(), flush=True)
    rows = []
    for experts in args.experts:
        source = save_moe(args.workdir / f"moe{experts}", experts, args.hidden, args.moe_intermediate, args.tokenizer)
        seconds, rss, summary = compress(args, source, args.workdir / f"out{experts}")
        rows.append({"experts": experts, "peak_rss_kib": rss, "wall_s": round(seconds, 1)})
        rows[-1]["peak_estimate_mib"] = round(summary.get("peak_estimate_bytes", 0) / 2**20, 1)
        rows[-1]["expert_group"] = summary.get("expert_group", 0) or None
        if args.compare:
            reference = args.workdir / f"unbounded{experts}"
            _seconds, unbounded_rss, _summary = compress(args, source, reference, bounded=False)
            rows[-1]["unbounded_peak_rss_kib"] = unbounded_rss
            rows[-1]["identical"] = same_artifact(args.workdir / f"out{experts}", reference)
        print(
            f"{experts:4d} experts/layer: peak RSS {rss} KiB (largest of {args.ranks} process(es)), "
            f"estimate {rows[-1]['peak_estimate_mib']} MiB, expert group {rows[-1]['expert_group']}, "
            f"{seconds:.1f} s, budget {args.budget}, identical to unbounded: {rows[-1].get('identical')}",
            flush=True,
        )
    first, last = rows[0]["peak_rss_kib"], rows[-1]["peak_rss_kib"]
    if first and last:
        print(f"peak RSS ratio {rows[-1]['experts']} / {rows[0]['experts']} experts: {last / first:.2f}")
    print(json.dumps({"revision": revision(), "command": command_line(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
