"""Batched LUT matmul on the CPU: the W4A8 kernel against the float32 kernels and torch's GEMMs, per row count.

    PYTHONPATH=. .venv/bin/python scripts/bench/bench_w8.py [--threads 2] [--bits 4] [--rows 1 4 16 32] [--repeats 200]

For each SmolLM2-135M linear shape (out x in: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536) and
M rows of activations: the median and best time of
  * ``f32``   - the float32 LUT kernels (activations="float32", the default: the one batch-invariant matmul),
  * ``int8``  - the W4A8 kernel (activations="int8"),
  * ``bf16``  - torch's bfloat16 F.linear on the dequantized weight,
  * ``fp32``  - torch's float32 F.linear on the dequantized weight;
then the ratios the issue asks for: int8 t(16)/t(1) (target <= 2.5) and int8 throughput at 32 rows against
torch's bf16 GEMM (target >= 1x, i.e. t_bf16(32) / t_int8(32)). Times are best-of (the minimum of
``--repeats`` single calls after a warm-up), which is what a shared machine measures most reliably; medians
are printed alongside. Never asserted anywhere: a measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.kernels.cpu_lut import cpu_lut_linear, prepare_cpu

SHAPES = [(576, 576, "q/o"), (192, 576, "k/v"), (1536, 576, "gate/up"), (576, 1536, "down")]


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of one call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bits", type=int, default=4, choices=(3, 4))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    assert kernels is not None, "the native kernels did not build"
    print(f"isa {kernels.isa}, threads {args.threads}, {args.bits}-bit LUT weights, best (median) microseconds")
    g = torch.Generator().manual_seed(0)
    for rows, n, name in SHAPES:
        w = torch.randn(rows, n, generator=g) * 0.02
        q = quantize_lut(w, None, args.bits)
        exact, fast = prepare_cpu(q, activations="float32"), prepare_cpu(q, activations="int8")
        assert exact is not None and fast is not None and fast.activations == "int8"
        dense = q.dequantize(torch.float32)
        dense_bf16 = dense.to(torch.bfloat16)
        best: dict[tuple[str, int], float] = {}
        lines = []
        for m in args.rows:
            x = torch.randn(m, n, generator=g)
            x_bf16 = x.to(torch.bfloat16)
            fns: dict[str, Callable[[], object]] = {
                "f32": partial(cpu_lut_linear, x, exact),
                "int8": partial(cpu_lut_linear, x, fast),
                "bf16": partial(F.linear, x_bf16, dense_bf16),
                "fp32": partial(F.linear, x, dense),
            }
            cells = []
            for label, fn in fns.items():
                b, med = timed(fn, args.repeats)
                best[(label, m)] = b
                cells.append(f"{label} {b * 1e6:7.1f} ({med * 1e6:7.1f})")
            lines.append(f"  M={m:<3} " + "  ".join(cells))
        print(f"{name} {rows}x{n}")
        print("\n".join(lines))
        if (1 in args.rows) and (16 in args.rows):
            growth = best[("int8", 16)] / best[("int8", 1)]
            old = best[("f32", 16)] / best[("f32", 1)]
            print(
                f"  t(16)/t(1): int8 {growth:.2f} (float32 kernels {old:.2f}); int8 vs f32 at 1 row: "
                f"{best[('f32', 1)] / best[('int8', 1)]:.2f}x, at 16: {best[('f32', 16)] / best[('int8', 16)]:.2f}x"
            )
        if 32 in args.rows:
            print(
                f"  at 32 rows: int8 throughput / torch bf16 GEMM {best[('bf16', 32)] / best[('int8', 32)]:.2f}x, "
                f"/ torch fp32 GEMM {best[('fp32', 32)] / best[('int8', 32)]:.2f}x"
            )


if __name__ == "__main__":
    main()
