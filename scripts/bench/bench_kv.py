"""KV-cache quantization: perplexity, bytes per token and CPU decode speed, side by side in one run.

    .venv/bin/python scripts/bench/bench_kv.py                       # SmolLM2-135M, sotu -> wikitext2 40 x 512
    .venv/bin/python scripts/bench/bench_kv.py --eval-windows 10 --skip-decode

Calibration (``squeeze.calibrate.kv_capture.calibrate_kv``, what ``squeeze calibrate-kv`` runs) on
../shared/corpora/sotu.txt; evaluation on ../shared/corpora/wikitext2_raw_test.txt (512-token windows, the
first 40), every window scored through a fresh cache: full precision, int8 and int4 calibrated, and the
uncalibrated baselines (per-token absmax keys and values). Bytes per token count codes and per-token fp16
scales/zeros over all layers. Decode speed: greedy tokens/s after a prompt of --context tokens, each cache
timed in turns (--repeats rounds), reported as a ratio to the full-precision cache. Writes JSON (--out) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from transformers import DynamicCache  # noqa: E402

from squeeze.calibrate.kv_capture import calibrate_kv  # noqa: E402
from squeeze.calibrate.windows import read_text_file, sample_windows, tokenize_text  # noqa: E402
from squeeze.errors import ConfigError  # noqa: E402
from squeeze.eval.perplexity import perplexity_from_ids  # noqa: E402
from squeeze.limits import DEFAULT_SINK_TOKENS  # noqa: E402
from squeeze.models.modes import cache_kwarg  # noqa: E402
from squeeze.models.source import load_model, resolve_model  # noqa: E402
from squeeze.quant.kv_bytes import fp_bytes_per_token, kv_geometry  # noqa: E402
from squeeze.quant.kv_spec import KVSpec  # noqa: E402
from squeeze.runtime.quantized_cache import SqueezeKVCache  # noqa: E402


def decode_seconds(model, prompt: torch.Tensor, new_tokens: int, make_cache) -> float:  # noqa: ANN001
    """Seconds for ``new_tokens`` greedy steps after a prefill of ``prompt (1, T)`` (prefill not counted)."""
    cache = make_cache()
    key = cache_kwarg(model)
    with torch.inference_mode():
        logits = model(input_ids=prompt, use_cache=True, **{key: cache}).logits
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = model(input_ids=token, use_cache=True, **{key: cache}).logits
            token = logits[:, -1:].argmax(-1)
        return time.perf_counter() - start


def add_data_arguments(parser: argparse.ArgumentParser, eval_windows: int) -> None:
    """The model, calibration and evaluation options the KV scripts share (bench_kv, ablate_kv)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", default=str(SHARED / "corpora" / "sotu.txt"))
    parser.add_argument("--eval-text", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--calib-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=eval_windows)


def load_data(args: argparse.Namespace):  # noqa: ANN201
    """(model fp32, tokenizer, calibration windows (n, T) int64, evaluation ids (1, N) int64) from the options."""
    model, tokenizer = load_model(resolve_model(args.model), dtype=torch.float32)
    calib_ids = tokenize_text(read_text_file(args.calibration, "calibration text", ConfigError), tokenizer)
    eval_ids = tokenize_text(read_text_file(args.eval_text, "evaluation text", ConfigError), tokenizer)
    return model, tokenizer, sample_windows(calib_ids, args.calib_windows, args.seq_len, seed=0), eval_ids


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(parser, eval_windows=40)
    parser.add_argument("--sink-tokens", type=int, default=DEFAULT_SINK_TOKENS)
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-eval", action="store_true", help="only calibrate and time decoding")
    parser.add_argument("--out", default="bench-out/kv.json")
    return parser.parse_args()


def calibrate_specs(model, windows: torch.Tensor, sink_tokens: int):  # noqa: ANN001, ANN201
    """({cache name: KVSpec or None (fp)}, {width: what its fit measured}) for fp, int8 / int4 calibrated and
    their uncalibrated (dynamic) baselines."""
    specs: dict[str, KVSpec | None] = {"fp": None}
    fits = {}
    for bits in (8, 4):
        t = time.perf_counter()
        fit = calibrate_kv(model, windows, bits, sink_tokens=sink_tokens)
        fits[f"int{bits}"] = {**fit.to_dict(), "seconds": round(time.perf_counter() - t, 1)}
        specs[f"int{bits}"] = fit.spec
        specs[f"int{bits}-dynamic"] = KVSpec.dynamic(bits, fit.spec.names, sink_tokens)
        print(f"calibrated int{bits} in {time.perf_counter() - t:.1f} s: {fits[f'int{bits}']}", flush=True)
    return specs, fits


def score_specs(
    model,
    eval_ids: torch.Tensor,
    specs: dict[str, KVSpec | None],  # noqa: ANN001
    args: argparse.Namespace,
) -> dict[str, dict[str, float | None]]:
    """Per cache: perplexity (NaN with --skip-eval) and bytes per token, also as a ratio to fp16."""
    layers, kv_heads, head_dim = kv_geometry(model.config)
    fp16 = fp_bytes_per_token(layers, kv_heads, head_dim)
    rows: dict[str, dict[str, float | None]] = {}
    for name, spec in specs.items():
        per_token = fp16 if spec is None else spec.bytes_per_token(kv_heads, head_dim)
        rows[name] = {
            "perplexity": float("nan"),
            "bytes_per_token": per_token,
            "bytes_ratio": per_token / fp16,
            "tokens_per_second_ratio": None,
        }
        if args.skip_eval:
            continue
        t = time.perf_counter()
        factory = None if spec is None else (lambda s=spec: SqueezeKVCache(s))
        result = perplexity_from_ids(
            model, eval_ids, seq_len=args.seq_len, max_windows=args.eval_windows, kv_cache=factory
        )
        rows[name]["perplexity"] = result.perplexity
        print(f"{name}: perplexity {result.perplexity:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
    return rows


def time_decode(
    model,
    eval_ids: torch.Tensor,
    specs: dict[str, KVSpec | None],  # noqa: ANN001
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Decode seconds per repeat for fp, int8 and int4, taken in turns so machine noise hits every cache alike."""
    prompt = eval_ids[None, : args.context]
    makers = {
        "fp": lambda: DynamicCache(config=model.config),
        "int8": lambda: SqueezeKVCache(specs["int8"]),
        "int4": lambda: SqueezeKVCache(specs["int4"]),
    }
    decode_seconds(model, prompt[:, :64], 4, makers["fp"])  # warm-up
    decode: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, make in makers.items():
            decode.setdefault(name, []).append(decode_seconds(model, prompt, args.new_tokens, make))
    return decode


def print_table(args: argparse.Namespace, rows: dict[str, dict[str, float | None]]) -> None:
    full = rows["fp"]["perplexity"]
    print(
        f"\nSmolLM2 KV cache, {args.eval_windows} x {args.seq_len} windows of {Path(args.eval_text).name}, "
        f"calibrated on {args.calib_windows} x {args.seq_len} of {Path(args.calibration).name}"
    )
    print(f"{'cache':<14}{'perplexity':>11}{'vs fp':>9}{'bytes/token':>13}{'vs fp16':>9}{'decode vs fp':>14}")
    for name, row in rows.items():
        ratio = row["tokens_per_second_ratio"]
        print(
            f"{name:<14}{row['perplexity']:>11.4f}{row['perplexity'] / full - 1:>+9.2%}{row['bytes_per_token']:>13}"
            f"{row['bytes_ratio']:>9.3f}{'' if ratio is None else f'{ratio:.2f}x':>14}"
        )


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    model, _, windows, eval_ids = load_data(args)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    specs, fits = calibrate_specs(model, windows, args.sink_tokens)
    rows = score_specs(model, eval_ids, specs, args)
    decode: dict[str, list[float]] = {}
    if not args.skip_decode:
        decode = time_decode(model, eval_ids, specs, args)
        base = statistics.median(decode["fp"])
        for name, times in decode.items():
            rows[name]["tokens_per_second"] = args.new_tokens / statistics.median(times)
            rows[name]["tokens_per_second_ratio"] = base / statistics.median(times)
    print_table(args, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "fits": fits, "rows": rows, "decode_seconds": decode}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
