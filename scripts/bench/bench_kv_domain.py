"""int4 KV calibrated on other text vs on the evaluated domain, with and without the key-scale search.

    .venv/bin/python scripts/bench/bench_kv_domain.py --model ART --in-domain ../shared/corpora/tinystories_sample.txt \
        --eval-text ../shared/corpora/tinystories_sample.txt --eval-seq-len 256           # stories260K (issue 18)
    .venv/bin/python scripts/bench/bench_kv_domain.py --calib-windows 16 --max-eval-windows 40   # SmolLM2, wikitext2

``--model``: a squeeze artifact (loaded verified, dense cache) or a model squeeze can open (fp32). The
model is loaded once; every calibration (texts x variants) runs ``squeeze.calibrate.kv_capture.calibrate_kv``, the
function ``squeeze calibrate-kv`` calls, and every score goes through the runtime's SqueezeKVCache, as
``squeeze eval`` does. One row per calibration text and variant: perplexity against full precision. The
point of the table: calibrating on the evaluated domain must never be worse than on sotu.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from squeeze.calibrate.kv_capture import calibrate_kv  # noqa: E402
from squeeze.calibrate.windows import sample_windows, tokenize_text  # noqa: E402
from squeeze.eval.perplexity import perplexity_from_ids  # noqa: E402
from squeeze.kvcache import SqueezeKVCache  # noqa: E402

#: variant name -> calibrate_kv keyword arguments
VARIANTS = {
    "search": {},
    "no-search": {"key_search": False},
    "static-centre": {"key_search": False, "key_rotation": False},
}


def load(model: str):  # noqa: ANN201
    from squeeze.runtime.loader import is_artifact, load_artifact
    from squeeze.runtime.options import LoadOptions

    if is_artifact(model):
        loaded = load_artifact(model, LoadOptions(verify=True, dense_cache=True))
        return loaded.model, loaded.tokenizer
    from squeeze.models.source import load_model, resolve_model

    return load_model(resolve_model(model), dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", default=str(SHARED / "corpora" / "sotu.txt"), help="the other text")
    parser.add_argument("--in-domain", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--eval-text", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--calib-windows", type=int, default=32)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--max-eval-windows", type=int, default=None)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--variants", default="search,no-search")
    parser.add_argument("--seeds", default="0", help="calibration window seeds, comma-separated: one row each")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="bench-out/kv-domain.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")

    model, tokenizer = load(args.model)
    eval_ids = tokenize_text(Path(args.eval_text).read_text(encoding="utf-8"), tokenizer)[None, :]

    def score(spec) -> float:  # noqa: ANN001
        factory = None if spec is None else (lambda: SqueezeKVCache(spec))
        result = perplexity_from_ids(
            model, eval_ids, seq_len=args.eval_seq_len, max_windows=args.max_eval_windows, kv_cache=factory
        )
        return result.perplexity

    full = score(None)
    print(f"full precision: {full:.4f}", flush=True)
    rows = []
    for label, path in (("other", args.calibration), ("in-domain", args.in_domain)):
        ids = tokenize_text(Path(path).read_text(encoding="utf-8"), tokenizer)
        for seed, variant in ((int(s), v) for s in args.seeds.split(",") for v in variants):
            windows = sample_windows(ids, args.calib_windows, args.calib_seq_len, seed=seed)
            t0 = time.perf_counter()
            spec = calibrate_kv(model, windows, args.bits, **VARIANTS[variant]).spec
            seconds = time.perf_counter() - t0
            ppl = score(spec)
            row = {
                "calibration": label,
                "text": Path(path).name,
                "variant": variant,
                "seed": seed,
                "perplexity": ppl,
                "vs_full": ppl / full - 1,
                "calibrate_seconds": seconds,
            }
            rows.append(row)
            print(
                f"{label:9s} {Path(path).name:26s} {variant:14s} seed {seed} {ppl:.4f} {100 * row['vs_full']:+.2f}%  "
                f"calibrate {seconds:.1f} s",
                flush=True,
            )
    print(
        f"\n{args.model}: int{args.bits}, calibration {args.calib_windows} x {args.calib_seq_len}, "
        f"eval {Path(args.eval_text).name} windows of {args.eval_seq_len}; full precision {full:.4f}"
    )
    print("| calibration | variant | seed | perplexity | vs full precision |\n|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['text']} | {row['variant']} | {row['seed']} | {row['perplexity']:.4f} "
            f"| {100 * row['vs_full']:+.2f}% |"
        )
    for variant in variants:
        pairs = [
            [r["perplexity"] for r in rows if r["variant"] == variant and r["calibration"] == c]
            for c in ("other", "in-domain")
        ]
        worse = sum(d > o for o, d in zip(*pairs, strict=True))
        mean_other, mean_domain = (sum(p) / len(p) for p in pairs)
        print(
            f"{variant}: in-domain worse for {worse} of {len(pairs[0])} seeds; mean {mean_domain:.4f} in-domain vs "
            f"{mean_other:.4f} ({100 * (mean_domain / full - 1):+.2f}% vs {100 * (mean_other / full - 1):+.2f}%)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "full": full, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
