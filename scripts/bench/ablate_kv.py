"""int4 KV-cache ablations: which part of the calibrated int4 cache buys how much perplexity.

    .venv/bin/python scripts/bench/ablate_kv.py                      # SmolLM2-135M, sotu -> wikitext2, 10 x 512

Keys and values are captured once on the calibration text (squeeze.calibrate.kv_capture.capture_kv, as
``squeeze calibrate-kv`` does); every variant fits its quantizers with squeeze.calibrate.kv_fit and is scored
through a cache that fake-quantizes with the same reference functions the runtime cache is tested to match
bit for bit (tests/runtime/test_kvcache.py). "keys only" / "values only" leave the other half in full
precision. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_kv import add_data_arguments, load_data  # noqa: E402  (scripts/bench/ is on sys.path when run as a script)
from transformers import DynamicCache  # noqa: E402

from squeeze.calibrate.kv_capture import capture_kv  # noqa: E402
from squeeze.calibrate.kv_fit import fit_keys, fit_value_codebook, fit_values  # noqa: E402
from squeeze.eval.perplexity import perplexity_from_ids  # noqa: E402
from squeeze.quant.kmeans import weighted_kmeans_1d  # noqa: E402
from squeeze.quant.kv import (  # noqa: E402
    codebook_scale,
    dequantize,
    dequantize_codebook,
    fake_quantize_keys,
    quantize,
    quantize_codebook,
    token_grid,
)

Quantizer = Callable[[Tensor], Tensor]  # (B, H, T, D) -> the same, fake-quantized


class FakeQuantCache(DynamicCache):
    """A DynamicCache that stores fake-quantized keys / values (None: that half stays exact); the first
    ``sink`` positions of every layer are kept as given."""

    def __init__(self, config: object, keys: list[Quantizer] | None, values: list[Quantizer] | None, sink: int):
        super().__init__(config=config)
        self.kq, self.vq, self.sink = keys, values, sink
        self.seen: dict[int, int] = {}

    def update(self, k: Tensor, v: Tensor, layer_idx: int, *args: object, **kwargs: object):  # noqa: ANN201
        start = self.seen.get(layer_idx, 0)
        keep = max(0, self.sink - start)
        self.seen[layer_idx] = start + k.shape[2]
        if self.kq is not None:
            k = torch.cat([k[:, :, :keep], self.kq[layer_idx](k[:, :, keep:])], dim=2)
        if self.vq is not None:
            v = torch.cat([v[:, :, :keep], self.vq[layer_idx](v[:, :, keep:])], dim=2)
        return super().update(k, v, layer_idx, *args, **kwargs)


def key_quantizers(keys: list[Tensor], group: int | None) -> list[Quantizer]:
    """Per-channel normaliser + per-token grids of ``group`` channels, fitted per layer."""
    out = []
    for samples in keys:
        fit = fit_keys(samples, 4, group)
        scale, zero = fit.scale[None, :, None, :], fit.zero[None, :, None, :]
        out.append(lambda x, s=scale, z=zero: fake_quantize_keys(x, s, z, 4, group))
    return out


def grid_value_quantizers(values: list[Tensor]) -> list[Quantizer]:
    """Uniform per-token grids per head with a calibrated clipping ratio (the int8 layout)."""
    out = []
    for samples in values:
        fit = fit_values(samples, 4)

        # defaults bind this layer's fit (a closure would see the loop's last one)
        def quantizer(
            x: Tensor,
            clip: Tensor = fit.clip.reshape(1, -1, 1, 1),  # noqa: B008 - bound per closure on purpose
            symmetric: bool = fit.symmetric,
        ) -> Tensor:
            scale, offset = token_grid(x, 4, clip, symmetric)
            return dequantize(quantize(x, scale, offset, 4), scale, offset)

        out.append(quantizer)
    return out


def unweighted_levels(samples: Tensor) -> Tensor:
    """The alternative to fit_value_codebook's k-means weighted by scale**2: every token's relative error alike."""
    grouped = samples.unsqueeze(-2)  # (N, H, 1, D): one grid per head
    scaled = (grouped / codebook_scale(grouped)).reshape(1, -1)
    return weighted_kmeans_1d(scaled, torch.ones_like(scaled), 16)[0][0]


def codebook_value_quantizers(values: list[Tensor], unweighted: bool = False) -> list[Quantizer]:
    """A 16-level codebook per layer on absmax-scaled values (the int4 default; ``unweighted``: the alternative)."""
    out = []
    for samples in values:
        levels = unweighted_levels(samples) if unweighted else fit_value_codebook(samples, 4).levels
        assert levels is not None

        def quantizer(x: Tensor, levels: Tensor = levels) -> Tensor:
            scale = codebook_scale(x)
            return dequantize_codebook(quantize_codebook(x, scale, levels), scale, levels)

        out.append(quantizer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(parser, eval_windows=10)
    parser.add_argument("--out", default="bench-out/kv-ablations.json")
    args = parser.parse_args()

    model, _, windows, eval_ids = load_data(args)
    keys, values = capture_kv(model, windows, 1)

    def ppl(kq: list[Quantizer] | None, vq: list[Quantizer] | None, sink: int) -> float:
        factory = None if kq is None and vq is None else (lambda: FakeQuantCache(model.config, kq, vq, sink))
        return perplexity_from_ids(
            model, eval_ids, seq_len=args.seq_len, max_windows=args.eval_windows, kv_cache=factory
        ).perplexity

    k_head, k_32 = key_quantizers(keys, None), key_quantizers(keys, 32)
    v_grid, v_codebook = grid_value_quantizers(values), codebook_value_quantizers(values)
    variants: dict[str, tuple[list[Quantizer] | None, list[Quantizer] | None, int]] = {
        "full precision": (None, None, 1),
        "previous int4: key grid per head, value grid with clip, sink 1": (k_head, v_grid, 1),
        "  keys only (key grid per head)": (k_head, None, 1),
        "  values only (value grid with clip)": (None, v_grid, 1),
        "keys only, grids of 32 channels": (k_32, None, 1),
        "values only, codebook": (None, v_codebook, 1),
        "values only, codebook, unweighted k-means": (None, codebook_value_quantizers(values, unweighted=True), 1),
        "key grids of 32 + value grid with clip, sink 1": (k_32, v_grid, 1),
        "key grid per head + value codebook, sink 1": (k_head, v_codebook, 1),
        "key grids of 32 + value codebook, sink 1": (k_32, v_codebook, 1),
        "key grids of 32 + value codebook, sink 4 (the default)": (k_32, v_codebook, 4),
    }
    rows: dict[str, float] = {}
    for name, (kq, vq, sink) in variants.items():
        t = time.perf_counter()
        rows[name] = ppl(kq, vq, sink)
        print(f"{name}: {rows[name]:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
    full = rows["full precision"]
    print(f"\nint4 KV ablations, {args.eval_windows} x {args.seq_len} windows of {Path(args.eval_text).name}")
    print(f"{'variant':<62}{'perplexity':>11}{'vs fp':>9}")
    for name, value in rows.items():
        print(f"{name:<62}{value:>11.4f}{value / full - 1:>+9.2%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "perplexity": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
