"""fp8 KV scales for vLLM: perplexity of fp8 KV (calibrated per-layer scales) next to full precision, int8, int4.

    .venv/bin/python scripts/bench/bench_kv_fp8.py              # SmolLM2-135M w4 artifact, sotu -> wikitext2, 40 x 512

The artifact (default artifacts/smollm2-135m-w4) is never modified: it is copied three times under --work, and
each copy is calibrated as ``squeeze calibrate-kv COPY --bits {fp8,8,4} -c sotu.txt --num-samples 16
--seq-len 512`` would (squeeze.api.calibrate_kv). The fp8 copy is then loaded once (verified, as ``squeeze eval``
loads it) and the same evaluation windows (squeeze.eval.perplexity, ``squeeze eval``'s protocol: WikiText-2
test, 512-token windows, the first 40, a fresh cache per window, prefill tokens quantized too) are scored
through: no KV quantization; fp8 with the calibrated scales; fp8 with scale 1.0 (what vLLM uses when a
checkpoint has no scales); int8 and int4 as calibrated (their specs read from their copies; the weights of all
copies are the same bytes). Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from bench_common import command_line, revision  # noqa: E402  (scripts/bench/ is on sys.path when run as a script)

from squeeze import api  # noqa: E402
from squeeze.calibrate.windows import read_text_file  # noqa: E402
from squeeze.errors import ConfigError  # noqa: E402
from squeeze.eval.perplexity import perplexity  # noqa: E402
from squeeze.quant.kv_bytes import fp_bytes_per_token, kv_geometry  # noqa: E402
from squeeze.quant.kv_spec import KVSpec, LayerFP8  # noqa: E402
from squeeze.runtime.loader import load_artifact  # noqa: E402
from squeeze.runtime.options import LoadOptions  # noqa: E402
from squeeze.runtime.quantized_cache import SqueezeKVCache  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default=str(REPO / "artifacts" / "smollm2-135m-w4"))
    parser.add_argument("--work", default=str(REPO / "bench-out" / "kv-fp8"), help="where the calibrated copies go")
    parser.add_argument("--calibration", default=str(SHARED / "corpora" / "sotu.txt"))
    parser.add_argument("--eval-text", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--calib-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--out", default="bench-out/kv-fp8.json")
    return parser.parse_args()


def calibrated_copies(args: argparse.Namespace) -> dict[str, Path]:
    """{"fp8" / "int8" / "int4": a calibrated copy of the artifact}, with the seconds each calibration took."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    copies = {}
    for bits in ("fp8", 8, 4):
        name = bits if isinstance(bits, str) else f"int{bits}"
        copy = work / f"{Path(args.artifact).name}-kv-{name}"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(args.artifact, copy)
        started = time.perf_counter()
        api.calibrate_kv(
            copy,
            args.calibration,
            bits=bits,
            calibration_overrides={"num_samples": args.calib_windows, "seq_len": args.seq_len},
        )
        print(f"calibrated {name} in {time.perf_counter() - started:.1f} s: {copy}", flush=True)
        copies[name] = copy
    return copies


def main() -> None:
    args = parse_args()
    print(revision())
    print(command_line(), flush=True)
    copies = calibrated_copies(args)
    loaded = load_artifact(copies["fp8"], LoadOptions(verify=True))
    model, tokenizer = loaded.model, loaded.tokenizer
    fp8 = loaded.kv_spec
    assert fp8 is not None and fp8.label == "fp8"
    specs: dict[str, KVSpec | None] = {
        "full precision (no KV quantization)": None,
        "fp8, calibrated per-layer scales": fp8,
        "fp8, scale 1.0 (vLLM's default without scales)": KVSpec.fp8(
            fp8.names, tuple(LayerFP8(torch.ones(()), torch.ones(())) for _ in fp8.names)
        ),
    }
    for name in ("int8", "int4"):
        spec = load_artifact(copies[name], LoadOptions(verify=True)).kv_spec
        assert spec is not None and spec.label == name
        specs[f"{name}, calibrated (squeeze)"] = spec
    text = read_text_file(args.eval_text, "evaluation text", ConfigError)
    layers, kv_heads, head_dim = kv_geometry(model.config)
    fp16 = fp_bytes_per_token(layers, kv_heads, head_dim)
    rows = {}
    for label, spec in specs.items():
        started = time.perf_counter()
        factory = None if spec is None else (lambda s=spec: SqueezeKVCache(s))
        windows = {"seq_len": args.seq_len, "max_windows": args.eval_windows}
        result = perplexity(model, tokenizer, text, **windows, kv_cache=factory)
        per_token = fp16 if spec is None else spec.bytes_per_token(kv_heads, head_dim)
        rows[label] = {"perplexity": result.perplexity, "windows": result.n_windows, "bytes_per_token": per_token}
        print(f"{label}: {result.perplexity:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    full = rows["full precision (no KV quantization)"]["perplexity"]
    print(
        f"\n{Path(args.artifact).name}, {args.eval_windows} x {args.seq_len} windows of {Path(args.eval_text).name}, "
        f"KV calibrated on {args.calib_windows} x {args.seq_len} of {Path(args.calibration).name}\n"
    )
    print("| KV cache | perplexity | vs full precision | bytes / token (all layers) | vs fp16 |")
    print("|---|---|---|---|---|")
    for label, row in rows.items():
        change = "-" if row["perplexity"] == full else f"{row['perplexity'] / full - 1:+.2%}"
        print(
            f"| {label} | {row['perplexity']:.4f} | {change} | {row['bytes_per_token']} | "
            f"{row['bytes_per_token'] / fp16:.3f} |"
        )
    scales = [(float(layer.k_scale), float(layer.v_scale)) for layer in fp8.layers if isinstance(layer, LayerFP8)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "fp8_scales": scales}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
