#!/usr/bin/env python
"""Benchmark squeeze's vectorised weighted 1-D k-means against sklearn's per-row KMeans.

For each layer shape (rows x in_features) a heavy-tailed random layer (Student-t, df=4) with positive
Fisher-like weights (squared Gaussian noise) is clustered per row with 2**bits centroids:

* ours: ``squeeze.quant.kmeans.weighted_kmeans_1d`` on the whole layer (best of --repeats runs);
* sklearn: ``KMeans(n_clusters=2**bits, n_init='auto', max_iter=50, random_state=0)`` with
  ``sample_weight``, one row at a time, on --sk-rows sampled rows (best of --repeats passes), per row.

It prints per-row times, the speed-up and the weighted-SSE ratio (ours / sklearn, on the sampled rows;
< 1 means ours is better) and writes the same as JSON to --out.

Threads: both sides run with --threads threads (default 1: per-core work is the fair comparison, and on a
small shared VM an OpenMP parallel region can cost milliseconds, which would swamp either side).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from squeeze.quant.kmeans import weighted_kmeans_1d  # noqa: E402


def make_layer(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A heavy-tailed weight matrix and positive sensitivities, both float32 (rows, cols)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=g)
    chi2 = (torch.randn(rows, cols, 4, generator=g) ** 2).sum(-1)  # Student-t(4) = N / sqrt(chi2_4 / 4)
    weight = 0.02 * normal / (chi2 / 4).sqrt()
    fisher = torch.randn(rows, cols, generator=g) ** 2 + 1e-6
    return weight, fisher


def weighted_sse(x: np.ndarray, w: np.ndarray, centroids: np.ndarray) -> float:
    """sum_j w_j * min_c (x_j - c)^2 in float64."""
    d = (x[:, None].astype(np.float64) - centroids[None, :].astype(np.float64)) ** 2
    return float((w.astype(np.float64) * d.min(1)).sum())


def bench_one(rows: int, cols: int, bits: int, args: argparse.Namespace) -> dict:
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    k = 2**bits
    weight, fisher = make_layer(rows, cols, args.seed)
    weighted_kmeans_1d(weight[:8], fisher[:8], k)  # warm-up (allocator, numpy import paths)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        centroids, _codes = weighted_kmeans_1d(weight, fisher, k)
        times.append(time.perf_counter() - t0)
    ours_per_row = min(times) / rows

    sample = np.random.default_rng(args.seed).choice(rows, size=min(args.sk_rows, rows), replace=False)
    rows_x = [weight[int(r)].numpy().astype(np.float64) for r in sample]
    rows_f = [fisher[int(r)].numpy().astype(np.float64) for r in sample]
    passes, fits = [], []
    with threadpool_limits(args.threads):
        KMeans(n_clusters=k, n_init="auto", max_iter=50, random_state=0).fit(rows_x[0].reshape(-1, 1))  # warm-up
        for _ in range(args.repeats):  # same statistic as ours: the fastest pass over the sampled rows
            t0 = time.perf_counter()
            fits = [
                KMeans(n_clusters=k, n_init="auto", max_iter=50, random_state=0).fit(x.reshape(-1, 1), sample_weight=f)
                for x, f in zip(rows_x, rows_f, strict=True)
            ]
            passes.append(time.perf_counter() - t0)
    ratios = []
    for r, x, f, fit in zip(sample, rows_x, rows_f, fits, strict=True):
        ref = weighted_sse(x, f, fit.cluster_centers_.ravel())
        ours = weighted_sse(x, f, centroids[int(r)].numpy())
        ratios.append(ours / ref if ref > 0 else 1.0)
    sk_per_row = min(passes) / len(sample)
    return {
        "rows": rows,
        "cols": cols,
        "bits": bits,
        "ours_ms_per_row": ours_per_row * 1e3,
        "ours_total_s": min(times),
        "sklearn_ms_per_row": sk_per_row * 1e3,
        "sklearn_rows_timed": len(sample),
        "speedup": sk_per_row / ours_per_row,
        "sse_ratio_mean": statistics.mean(ratios),
        "sse_ratio_max": max(ratios),
        "sse_ratio_min": min(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-out/kmeans.json"))
    parser.add_argument(
        "--shapes", nargs="+", default=["576x1536", "4096x4096"], help="ROWSxCOLS (torch weight shape: out x in)"
    )
    parser.add_argument("--bits", nargs="+", type=int, default=[3, 4])
    parser.add_argument("--sk-rows", type=int, default=32, help="rows timed with sklearn (per shape/bits)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch and sklearn threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    results = []
    header = (
        f"{'layer':>11} {'bits':>4} {'ours ms/row':>12} {'sklearn ms/row':>15} {'speed-up':>9} "
        f"{'SSE ratio mean/max':>19}"
    )
    print(header)
    print("-" * len(header))
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.lower().split("x"))
        for bits in args.bits:
            r = bench_one(rows, cols, bits, args)
            results.append(r)
            print(
                f"{rows:>5}x{cols:<5} {bits:>4} {r['ours_ms_per_row']:>12.4f} {r['sklearn_ms_per_row']:>15.3f} "
                f"{r['speedup']:>8.1f}x {r['sse_ratio_mean']:>9.4f}/{r['sse_ratio_max']:.4f}"
            )
    payload = {
        "benchmark": "weighted_kmeans_1d vs sklearn KMeans (per row)",
        "threads": args.threads,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
