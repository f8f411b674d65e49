"""Would lossless coding shrink an artifact? Empirical entropy of its packed codes and 16-bit tensors.

    .venv/bin/python scripts/bench/bench_entropy.py /work/artifacts/smol-w4

For every quantized linear: the order-0 entropy of its codes (one histogram per layer) and the mean of its
per-row entropies (each row's own histogram: what a coder with one table per row could reach, before the
table's cost). For every 16-bit tensor kept as-is (the tied embedding, norms): the entropy of its exponent
field, as stored (float16: 5 bits) and as it would be in bfloat16 (8 bits); sign and mantissa are counted as
incompressible (their entropy is within a few hundredths of a bit of their width on trained weights, as
DFloat11 reports for bf16). Prints per-layer rows, then what an ideal entropy coder would save: bytes and the
fraction of the artifact's safetensors bytes. Nothing is written; the artifact is only read (safetensors,
never unpickled).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from squeeze.quant.packing import unpack_codes  # noqa: E402


def entropy_bits(counts: torch.Tensor) -> float:
    """Shannon entropy in bits per symbol of a histogram (1-D counts)."""
    p = counts.to(torch.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def row_entropy_bits(codes: torch.Tensor, levels: int) -> float:
    """Mean over rows of each row's own order-0 entropy, codes int64 (R, N)."""
    counts = torch.zeros(codes.shape[0], levels, dtype=torch.float64)
    counts.scatter_add_(1, codes, torch.ones_like(codes, dtype=torch.float64))
    p = counts / counts.sum(dim=1, keepdim=True)
    terms = torch.where(p > 0, -p * p.clamp_min(1e-300).log2(), torch.zeros_like(p))
    return float(terms.sum(dim=1).mean())


def exponent_entropy(t: torch.Tensor) -> tuple[float, int, float, int]:
    """(entropy of the exponent field as stored, its width, entropy of bf16's exponent, 8) for a 16-bit tensor."""
    if t.dtype == torch.float16:
        bits, width = t.flatten().view(torch.int16).to(torch.int32) & 0xFFFF, 5
        stored = torch.bincount((bits >> 10) & 0x1F, minlength=32)
    elif t.dtype == torch.bfloat16:
        bits, width = t.flatten().view(torch.int16).to(torch.int32) & 0xFFFF, 8
        stored = torch.bincount((bits >> 7) & 0xFF, minlength=256)
    else:
        raise ValueError(f"a 16-bit float tensor, found {t.dtype}")
    bf = t.flatten().to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return entropy_bits(stored), width, entropy_bits(torch.bincount((bf >> 7) & 0xFF, minlength=256)), 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--per-layer", action="store_true", help="print every linear's row")
    args = parser.parse_args()
    from safetensors import safe_open

    config = json.loads((args.artifact / "config.json").read_text())["quantization_config"]
    modules = config["modules"]
    shards = sorted(args.artifact.glob("model-*.safetensors"))
    total_bytes = sum(p.stat().st_size for p in shards)
    code_bytes = code_ideal = code_row_ideal = 0.0
    kept_bytes = kept_ideal = kept_ideal_bf16 = 0.0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.endswith(".weight_packed"):
                    name = key.removesuffix(".weight_packed")
                    spec = modules[name]
                    bits, cols = int(spec["bits"]), int(spec["in_features"])
                    packed = handle.get_tensor(key)
                    codes = unpack_codes(packed, bits, cols).to(torch.int64)
                    h = entropy_bits(torch.bincount(codes.flatten(), minlength=1 << bits))
                    hr = row_entropy_bits(codes, 1 << bits)
                    n = packed.numel()
                    code_bytes += n
                    code_ideal += codes.numel() * h / 8
                    code_row_ideal += codes.numel() * hr / 8
                    if args.per_layer:
                        print(f"{name:45s} {bits} bits: entropy {h:.3f} (per row {hr:.3f}), {n:,} bytes")
                elif key.endswith(".weight") and handle.get_slice(key).get_dtype() in ("F16", "BF16"):
                    t = handle.get_tensor(key)
                    he, width, hb, _ = exponent_entropy(t)
                    kept_bytes += 2 * t.numel()
                    kept_ideal += t.numel() * (16 - width + he) / 8
                    kept_ideal_bf16 += t.numel() * (16 - 8 + hb) / 8
                    if t.numel() > 1_000_000 or args.per_layer:
                        print(
                            f"{key:45s} {str(t.dtype):14s} {t.numel():,} values: exponent entropy {he:.3f} of {width} "
                            f"bits (as bf16: {hb:.3f} of 8)"
                        )
    saved_codes, saved_rows = code_bytes - code_ideal, code_bytes - code_row_ideal
    saved_kept = kept_bytes - kept_ideal
    print(f"\n{args.artifact}: safetensors shards {total_bytes:,} bytes")
    print(
        f"packed codes   {code_bytes:12,.0f} bytes -> ideal {code_ideal:12,.0f} (one table per layer; "
        f"per row {code_row_ideal:,.0f}): saves {saved_codes / total_bytes:.2%} ({saved_rows / total_bytes:.2%})"
    )
    print(
        f"16-bit tensors {kept_bytes:12,.0f} bytes -> ideal {kept_ideal:12,.0f} (exponents coded, as stored): "
        f"saves {saved_kept / total_bytes:.2%}; as bf16 {kept_ideal_bf16:,.0f} ({kept_ideal_bf16 / kept_bytes:.3f}x)"
    )
    best = saved_codes + saved_kept
    print(f"both, as stored: saves {best:,.0f} bytes = {best / total_bytes:.2%} of the shards (ideal coder)")


if __name__ == "__main__":
    main()
