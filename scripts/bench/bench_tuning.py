"""Block-wise tuning (weights.tuning) against the same recipe untuned: perplexity, compress time and memory, one run.

    .venv/bin/python scripts/bench/bench_tuning.py                                   # SmolLM2-135M: w3 vs w3-tuned
    .venv/bin/python scripts/bench/bench_tuning.py --recipes w3-ec,w3-ec-tuned --out /tmp/tuning.json

Each recipe is compressed by squeeze.api.compress (calibration: ../shared/corpora/sotu.txt, the built-in sotu
spec's 32 x 512 windows) into --work/<recipe>, then scored on ../shared/corpora/wikitext2_raw_test.txt (first 40
non-overlapping 512-token windows) by squeeze.api.evaluate, the uncompressed model on the same windows. Prints
one table: perplexity, its ratio to the first recipe's, compress seconds (the tune stage's among them) and the
process's peak resident memory after each compress (ru_maxrss: a high-water mark, so it only grows).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from squeeze import api  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/artifacts/smollm2-135m-hf")
    parser.add_argument("--recipes", default="w3,w3-tuned")
    parser.add_argument("--calibration", default=str(SHARED / "corpora" / "sotu.txt"))
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--text", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--work", default="/tmp/squeeze-bench-tuning")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-original", action="store_true", help="skip scoring the uncompressed model")
    args = parser.parse_args()
    rows = []
    original = float("nan")
    if not args.no_original:
        original = api.evaluate(args.model, args.text, seq_len=512, max_windows=args.eval_windows).result.perplexity
    print(f"original {original:.3f}", flush=True)
    for recipe in args.recipes.split(","):
        out = Path(args.work) / recipe
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        result = api.compress(
            args.model, out, recipe, args.calibration, calibration_overrides={"num_samples": args.num_samples}
        )
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ppl = api.evaluate(str(out), args.text, seq_len=512, max_windows=args.eval_windows).result.perplexity
        rows.append(
            {
                "recipe": recipe,
                "perplexity": ppl,
                "bits_per_weight": result.bits_per_weight,
                "compress_s": seconds,
                "tune_s": result.timings.get("tune", 0.0),
                "peak_rss_bytes": peak,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    first = rows[0]["perplexity"]
    print(f"\noriginal {original:.2f} (same windows)")
    print(f"{'recipe':<22}{'ppl':>9}{'x first':>9}{'bpw':>8}{'compress s':>12}{'tune s':>9}{'peak RSS GB':>13}")
    for row in rows:
        print(
            f"{row['recipe']:<22}{row['perplexity']:>9.2f}{row['perplexity'] / first:>9.3f}"
            f"{row['bits_per_weight']:>8.3f}{row['compress_s']:>12.0f}{row['tune_s']:>9.0f}"
            f"{row['peak_rss_bytes'] / 1e9:>13.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"original": original, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
