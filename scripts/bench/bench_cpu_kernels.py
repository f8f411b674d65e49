"""Kernel-level benchmark of the native CPU LUT kernels against torch's fp32 GEMM/GEMV, one run, side by side.

    .venv/bin/python scripts/bench/bench_cpu_kernels.py [--quick] [--repeats 15] [--json bench-out/cpu_kernels.json]
        [--shapes 4096x11008,...] [--batches 1,8,...] [--threads N] [--flush-mib 64] [--skip-int8]

Run it on a quiet machine: every kernel call is an OpenMP parallel region, and a thread descheduled by
another process stalls it (``--threads 1`` sidesteps that, for both sides).

(1) ``cpu_lut_linear(x, prepare_cpu(q))`` vs ``F.linear(x, W_fp32)`` (W = q.dequantize()) for weight shapes
    (out x in) 1536x576 and 576x1536 (SmolLM2-135M's MLP), 4096x4096, 11008x4096 and 4096x11008, codes at
    3 and 4 bits (random codes packed by squeeze.quant.packing.pack_codes, a random ascending fp16 LUT per
    row), and at 3 bits with a 0.45 % sparse part, for x of 1, 4, 8, 16, 64 and 512 rows (512: a prefill).
    Both sides alternate (A B A B ...) after a warm-up so machine noise hits them alike; medians.
    kernel GB/s = bytes the kernel reads for W (packed codes + the LUT as the kernel holds it + the sparse
    part's kernel form) / time, shown as a % of this machine's copy bandwidth timed in the same rounds: a
    torch copy of a 256 MiB uint8 buffer, counted STREAM-style as read + write bytes per second. The caches
    are flushed (64 MiB written, untimed) before every timed call, as a model's other layers would.
(2) The same at batch 1 for 4096x4096 under every instruction set this CPU runs (avx512, avx2, scalar).
(3) 8-bit-LUT weights (Lut8Weight: value = level * scale + zero per row, levels uint8): the LUT kernel vs
    expanding the codes to an int8 matrix of levels (level - 128) and torch's int8 weight-only matmul
    ``torch.ops.aten._weight_int8pack_mm(x, w_int8 (R, N), scales (R,))`` = x @ (w_int8 * scales[:, None])^T,
    plus the per-row offset: y = that + sum(x) * (128 * scale + zero). Time and memory (8 bits/weight).
(0) Row scaling of the one batch-invariant matmul, per SmolLM2-135M linear shape (576x576 q/o, 192x576 k/v,
    1536x576 gate/up, 576x1536 down; 4-bit codes), for each activation form (float32, bfloat16, int8): t(1), t(16) and
    t(32) rows, t(16)/t(1) (goal <= 2.0), and t(32) / torch's bf16 GEMM on the dequantized weight at 32 rows
    (goal <= 1.0). Min of ``--repeats`` interleaved rounds, caches warm (a busy shared machine inflates medians
    more than minima). ``--scaling-only`` runs just this table (under a minute).
Every number is a ratio measured in this run; the absolute milliseconds move with the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs
from torch import Tensor

from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes.lut import Lut8Weight, LutWeight
from squeeze.quant.sparse import SparseCSR
from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.kernels.cpu_lut import CpuPreparedLut, cpu_lut_linear, prepare_cpu

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (11008, 4096), (4096, 11008)]
QUICK_SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]
BATCHES = [1, 4, 8, 16, 64, 512]
QUICK_BATCHES = [1, 8, 512]
#: (bits, sparse fraction) of each weight variant
VARIANTS = [(4, 0.0), (3, 0.0), (3, 0.0045)]
INT8_BATCHES = [1, 4, 8, 512]
#: shapes whose weight (fp32: 64-180 MB) is far larger than the last-level cache: the bandwidth goal applies
BIG_SHAPES = {(4096, 4096), (11008, 4096), (4096, 11008)}
COPY_MIB = 256


def machine() -> dict[str, Any]:
    """CPU model, cores, threads, load average, torch version and the date, for the report."""
    model = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class CacheFlusher:
    """Evicts the caches between timed calls (untimed): in a model every layer's weights are gone from the
    last-level cache by the time that layer runs again, and a 4-bit 11008x4096 weight (25 MB) would fit."""

    def __init__(self, mib: int) -> None:
        self.buffer = torch.ones(max(mib, 0) << 18, dtype=torch.float32)  # mib MiB

    def __call__(self) -> None:
        if self.buffer.numel():
            self.buffer.add_(1.0)  # reads and writes every line


def interleaved_ms(
    fns: dict[str, Callable[[], object]], repeats: int, budget_s: float, flush: Callable[[], None]
) -> dict[str, float]:
    """Median milliseconds of each function, run in turn (A B C A B C ...) after one warm-up call each, the
    caches flushed (untimed) before every call.

    Runs ``repeats`` rounds, fewer (at least 3) when one round would push the total past ``budget_s``.
    """
    start = time.perf_counter()
    for fn in fns.values():
        flush()
        fn()
    warm = time.perf_counter() - start
    rounds = max(3, min(repeats, int(budget_s / max(warm, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            flush()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x11008' -> (4096, 11008) (out x in)."""
    try:
        out, _, inp = text.lower().partition("x")
        return int(out), int(inp)
    except ValueError:
        raise SystemExit(f"--shapes: expected OUTxIN such as 4096x11008, found {text!r}") from None


class Copier:
    """A torch copy of a 256 MiB uint8 buffer: the machine's memory bandwidth, timed beside every kernel."""

    def __init__(self) -> None:
        self.src = torch.randint(0, 255, (COPY_MIB << 20,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)

    def __call__(self) -> None:
        self.dst.copy_(self.src)

    def bps(self, ms: float) -> float:
        """STREAM-style bandwidth of one copy taking ``ms``: bytes read + bytes written per second."""
        return 2 * self.src.numel() / (ms / 1e3)


def copy_bandwidth(copier: Copier, repeats: int) -> float:
    """STREAM-style copy bandwidth (read + write bytes per second), median of ``repeats`` copies."""
    ms = interleaved_ms({"copy": copier}, max(repeats, 5), 5.0, CacheFlusher(0))["copy"]
    return copier.bps(ms)


def random_codes(rows: int, n: int, bits: int, gen: torch.Generator) -> Tensor:
    """uint8 (rows, n) codes uniform in [0, 2**bits)."""
    return torch.randint(0, 1 << bits, (rows, n), dtype=torch.uint8, generator=gen)


def random_lut_weight(rows: int, n: int, bits: int, sparse_fraction: float, gen: torch.Generator) -> LutWeight:
    """A LutWeight with random codes, a random ascending fp16 LUT per row and ``sparse_fraction`` exact weights."""
    codes = random_codes(rows, n, bits, gen)
    lut = torch.sort(torch.randn(rows, 1 << bits, generator=gen) * 0.02, dim=1).values.to(torch.float16)
    sparse = None
    if sparse_fraction > 0:
        mask = torch.rand(rows, n, generator=gen) < sparse_fraction
        sparse = SparseCSR.from_mask(mask, torch.randn(rows, n, generator=gen) * 0.1)
    return LutWeight(bits=bits, in_features=n, packed=pack_codes(codes, bits), lut=lut, sparse=sparse)


def random_lut8_weight(rows: int, n: int, bits: int, gen: torch.Generator) -> tuple[Lut8Weight, Tensor]:
    """A Lut8Weight with random codes and ascending levels, and its codes uint8 (rows, n)."""
    codes = random_codes(rows, n, bits, gen)
    levels = torch.sort(torch.randint(0, 256, (rows, 1 << bits), generator=gen), dim=1).values.to(torch.uint8)
    scale = (torch.rand(rows, 1, generator=gen) * 1e-3 + 1e-4).to(torch.float16)
    zero = (-128 * scale.to(torch.float32) + torch.randn(rows, 1, generator=gen) * 1e-3).to(torch.float16)
    weight = Lut8Weight(
        bits=bits, in_features=n, packed=pack_codes(codes, bits), lut=levels, lut_scale=scale, lut_zero=zero
    )
    return weight, codes


def weight_bytes(prepared: CpuPreparedLut) -> int:
    """Bytes of every tensor the kernel reads for W: the packed codes, the LUT as the kernel reads it (and its
    scale / zero for 8-bit levels), the sparse part's kernel form."""
    return sum(t.numel() * t.element_size() for t in prepared.keep)


#: SmolLM2-135M's LUT linear shapes (out x in): q/o, k/v, gate/up, down
SCALING_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
SCALING_ROWS = (1, 16, 32)


def min_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Minimum microseconds of each function over ``repeats`` interleaved rounds (after one warm-up call each)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1e6 * t for name, t in best.items()}


def scaling_table(args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, Any]]:
    """(0): t(M rows) of the one matmul per SmolLM2 shape and activation form, against torch's bf16 GEMM."""
    print(
        f"\n(0) the one matmul by rows of x, {torch.get_num_threads()} threads, 4-bit, min of {args.repeats} rounds;"
        " bf16 = F.linear(x.bf16, W.bf16) at 32 rows"
    )
    print(
        f"{'shape':>11s} {'form':>7s} {'t1 us':>8s} {'t16 us':>8s} {'t32 us':>8s} {'t16/t1':>7s} {'bf16 us':>8s} "
        f"{'t32/bf16':>8s}"
    )
    out = []
    for rows, n in SCALING_SHAPES:
        q = random_lut_weight(rows, n, 4, 0.0, gen)
        wbf16 = q.dequantize(torch.float32).to(torch.bfloat16)
        xs = {m: torch.randn(m, n, generator=gen) for m in SCALING_ROWS}
        xb = xs[32].to(torch.bfloat16)
        for form in ("float32", "bfloat16", "int8"):
            prepared = prepare_cpu(q, activations=form)  # type: ignore[arg-type]
            assert prepared is not None
            fns: dict[str, Callable[[], object]] = {str(m): partial(cpu_lut_linear, x, prepared) for m, x in xs.items()}
            fns["bf16"] = partial(F.linear, xb, wbf16)
            us = min_us(fns, args.repeats)
            row = {
                "shape": [rows, n],
                "form": form,
                **{f"t{m}_us": us[str(m)] for m in SCALING_ROWS},
                "bf16_t32_us": us["bf16"],
                "t16_over_t1": us["16"] / us["1"],
                "t32_over_bf16": us["32"] / us["bf16"],
            }
            out.append(row)
            print(
                f"{rows:>5d}x{n:<5d} {form:>7s} {us['1']:>8.1f} {us['16']:>8.1f} {us['32']:>8.1f} "
                f"{row['t16_over_t1']:>7.2f} {us['bf16']:>8.1f} {row['t32_over_bf16']:>8.2f}",
                flush=True,
            )
    return out


def kernel_table(args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, Any]]:
    """(1): LUT kernel vs F.linear over shapes, variants and batches."""
    rows_out = []
    print(
        f"\n(1) LUT kernel vs F.linear(fp32), {torch.get_num_threads()} threads; speed-up = fp32 ms / kernel ms;"
        " kern GB/s = W bytes read / time; % copy = of the copy bandwidth timed in the same rounds (read+write)"
    )
    print(
        f"{'shape':>11s} {'bits':>4s} {'sparse':>6s} {'batch':>5s} {'kernel ms':>10s} {'fp32 ms':>9s} "
        f"{'speed-up':>8s} {'kern GB/s':>9s} {'% copy':>6s} {'copy GB/s':>9s} {'fp32 GB/s':>9s} {'max|err|':>9s}"
    )
    for rows, n in args.shapes:
        for bits, sparse_fraction in VARIANTS:
            q = random_lut_weight(rows, n, bits, sparse_fraction, gen)
            prepared = prepare_cpu(q)
            if prepared is None:
                raise SystemExit("the native CPU kernels are unavailable here (no C++ compiler?)")
            dense = q.dequantize(torch.float32)  # (rows, n)
            wbytes = weight_bytes(prepared)
            for batch in args.batches:
                x = torch.randn(batch, n, generator=gen)
                err = float((cpu_lut_linear(x, prepared) - F.linear(x, dense)).abs().max())
                ms = interleaved_ms(
                    {
                        "kernel": partial(cpu_lut_linear, x, prepared),
                        "fp32": partial(F.linear, x, dense),
                        "copy": args.copier,
                    },
                    args.repeats,
                    args.budget,
                    args.flush,
                )
                row = {
                    "shape": [rows, n],
                    "bits": bits,
                    "sparse_fraction": sparse_fraction,
                    "nnz": q.sparse.nnz if q.sparse is not None else 0,
                    "batch": batch,
                    "kernel_ms": ms["kernel"],
                    "fp32_ms": ms["fp32"],
                    "speedup": ms["fp32"] / ms["kernel"],
                    "kernel_weight_bytes": wbytes,
                    "kernel_gbps": wbytes / ms["kernel"] / 1e6,
                    "copy_bps": args.copier.bps(ms["copy"]),
                    "kernel_pct_copy": 100 * wbytes / (ms["kernel"] / 1e3) / args.copier.bps(ms["copy"]),
                    "fp32_gbps": dense.numel() * 4 / ms["fp32"] / 1e6,
                    "max_abs_err": err,
                }
                rows_out.append(row)
                print(
                    f"{rows:>5d}x{n:<5d} {bits:>4d} {100 * sparse_fraction:>5.2f}% {batch:>5d} "
                    f"{ms['kernel']:>10.3f} {ms['fp32']:>9.3f} {row['speedup']:>7.2f}x {row['kernel_gbps']:>9.1f} "
                    f"{row['kernel_pct_copy']:>5.0f}% {row['copy_bps'] / 1e9:>9.1f} {row['fp32_gbps']:>9.1f} "
                    f"{err:>9.1e}",
                    flush=True,
                )
            del dense, prepared, q
    return rows_out


def isa_table(args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, Any]]:
    """(2): batch 1, 4096x4096, every instruction set this CPU runs, vs F.linear."""
    kernels = cpu_kernels()
    assert kernels is not None  # kernel_table already stopped when they are unavailable
    isas = [isa for isa in ("avx512", "avx2", "scalar") if kernels.supports(isa)]
    print(f"\n(2) batch 1, 4096x4096, by instruction set (this CPU runs: {', '.join(isas)})")
    print(
        f"{'isa':>7s} {'bits':>4s} {'kernel ms':>10s} {'fp32 ms':>9s} {'speed-up':>8s} {'kern GB/s':>9s} {'% copy':>6s}"
    )
    out = []
    for bits in (4, 3):
        q = random_lut_weight(4096, 4096, bits, 0.0, gen)
        dense = q.dequantize(torch.float32)
        x = torch.randn(1, 4096, generator=gen)
        prepared: dict[str, CpuPreparedLut] = {}
        for isa in isas:
            p = prepare_cpu(q, kernels.with_isa(isa))
            assert p is not None
            prepared[isa] = p
        fns: dict[str, Callable[[], object]] = {isa: partial(cpu_lut_linear, x, p) for isa, p in prepared.items()}
        fns["fp32"] = partial(F.linear, x, dense)
        fns["copy"] = args.copier
        ms = interleaved_ms(fns, args.repeats, args.budget, args.flush)
        copy_bps = args.copier.bps(ms["copy"])
        for isa in isas:
            wbytes = weight_bytes(prepared[isa])
            row = {
                "isa": isa,
                "bits": bits,
                "kernel_ms": ms[isa],
                "fp32_ms": ms["fp32"],
                "speedup": ms["fp32"] / ms[isa],
                "kernel_gbps": wbytes / ms[isa] / 1e6,
                "copy_bps": copy_bps,
                "kernel_pct_copy": 100 * wbytes / (ms[isa] / 1e3) / copy_bps,
            }
            out.append(row)
            print(
                f"{isa:>7s} {bits:>4d} {ms[isa]:>10.3f} {ms['fp32']:>9.3f} {row['speedup']:>7.2f}x "
                f"{row['kernel_gbps']:>9.1f} {row['kernel_pct_copy']:>5.0f}%",
                flush=True,
            )
    return out


def int8_linear(x: Tensor, w_int8: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """x (B, N) float32 -> (B, R): scale * (x @ w_int8^T) + sum(x) * offset, via torch's int8 weight-only mm."""
    y = torch.ops.aten._weight_int8pack_mm(x, w_int8, scale)  # (B, R) = x @ (w_int8 * scale[:, None])^T
    return torch.addmm(y, x.sum(dim=1, keepdim=True), offset[None, :])  # + (B, 1) @ (1, R)


def int8_table(args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, Any]]:
    """(3): 8-bit-LUT weights, the LUT kernel vs codes expanded to int8 levels + _weight_int8pack_mm."""
    print(
        "\n(3) 8-bit-LUT weights: LUT kernel vs int8 levels + torch.ops.aten._weight_int8pack_mm; "
        "ratio = int8 ms / kernel ms (> 1: the LUT kernel is faster)"
    )
    print(
        f"{'shape':>11s} {'bits':>4s} {'batch':>5s} {'kernel ms':>10s} {'int8 ms':>9s} {'fp32 ms':>9s} "
        f"{'int8/kern':>9s} {'faster':>6s} {'kern b/w':>8s} {'int8 b/w':>8s} {'err kern':>8s} {'err int8':>8s}"
    )
    out = []
    for rows, n in args.int8_shapes:
        for bits in (4, 3):
            q, codes = random_lut8_weight(rows, n, bits, gen)
            prepared = prepare_cpu(q)
            assert prepared is not None
            levels = torch.gather(q.lut, 1, codes.to(torch.int64))  # (rows, n) uint8: each weight's level
            w_int8 = (levels.to(torch.int16) - 128).to(torch.int8).contiguous()
            scale = q.lut_scale.to(torch.float32).reshape(rows).contiguous()  # (rows,)
            offset = (128 * scale + q.lut_zero.to(torch.float32).reshape(rows)).contiguous()  # (rows,)
            del levels, codes
            dense = q.dequantize(torch.float32)
            kern_bits = 8 * weight_bytes(prepared) / (rows * n)
            int8_bits = 8 * (w_int8.numel() + 4 * (scale.numel() + offset.numel())) / (rows * n)
            for batch in args.int8_batches:
                x = torch.randn(batch, n, generator=gen)
                ref = F.linear(x, dense)
                tol = float(ref.abs().max())
                err_k = float((cpu_lut_linear(x, prepared) - ref).abs().max()) / tol
                err_i = float((int8_linear(x, w_int8, scale, offset) - ref).abs().max()) / tol
                ms = interleaved_ms(
                    {
                        "kernel": partial(cpu_lut_linear, x, prepared),
                        "int8": partial(int8_linear, x, w_int8, scale, offset),
                        "fp32": partial(F.linear, x, dense),
                    },
                    args.repeats,
                    args.budget,
                    args.flush,
                )
                row = {
                    "shape": [rows, n],
                    "bits": bits,
                    "batch": batch,
                    "kernel_ms": ms["kernel"],
                    "int8_ms": ms["int8"],
                    "fp32_ms": ms["fp32"],
                    "int8_over_kernel": ms["int8"] / ms["kernel"],
                    "faster": "kernel" if ms["kernel"] < ms["int8"] else "int8",
                    "kernel_bits_per_weight": kern_bits,
                    "int8_bits_per_weight": int8_bits,
                    "kernel_rel_err": err_k,
                    "int8_rel_err": err_i,
                }
                out.append(row)
                print(
                    f"{rows:>5d}x{n:<5d} {bits:>4d} {batch:>5d} {ms['kernel']:>10.3f} {ms['int8']:>9.3f} "
                    f"{ms['fp32']:>9.3f} {row['int8_over_kernel']:>8.2f}x {row['faster']:>6s} {kern_bits:>8.2f} "
                    f"{int8_bits:>8.2f} {err_k:>8.1e} {err_i:>8.1e}",
                    flush=True,
                )
            del dense, w_int8, prepared, q
    return out


def summary(kernel: list[dict[str, Any]], int8: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal lines: bandwidth share on the big shapes at batch 1, and who wins the int8 comparison."""
    big = [r for r in kernel if tuple(r["shape"]) in BIG_SHAPES and r["batch"] == 1]
    wins: dict[str, int] = {"kernel": 0, "int8": 0}
    for r in int8:
        wins[r["faster"]] += 1
    return {
        "big_shapes_batch1_pct_copy_min": min((r["kernel_pct_copy"] for r in big), default=None),
        "big_shapes_batch1_pct_copy_median": statistics.median([r["kernel_pct_copy"] for r in big]) if big else None,
        "big_shapes_batch1_speedup_median": statistics.median([r["speedup"] for r in big]) if big else None,
        "int8_wins": wins,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, batches and repeats (~1-2 min)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per measurement (default 15; quick 5)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per measurement (default 4; quick 1.5)")
    parser.add_argument("--json", default=None, help="write every measurement to this JSON file")
    parser.add_argument("--skip-int8", action="store_true", help="skip (3), the 8-bit-LUT vs int8 matmul comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flush-mib", type=int, default=64, help="MiB written between timed calls to evict the caches (0: none)"
    )
    parser.add_argument("--shapes", dest="shapes_arg", default=None, help="OUTxIN,... instead of the default shapes")
    parser.add_argument("--batches", dest="batches_arg", default=None, help="B,... instead of the default batches")
    parser.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads (default: torch's)")
    parser.add_argument("--scaling-only", action="store_true", help="only (0), the row scaling per SmolLM2 shape")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels run torch.get_num_threads() threads too
    args.repeats = args.repeats or (5 if args.quick else 15)
    args.budget = args.budget or (1.5 if args.quick else 4.0)
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.batches = QUICK_BATCHES if args.quick else BATCHES
    args.int8_shapes = QUICK_SHAPES[:3] if args.quick else SHAPES
    args.int8_batches = [1, 8, 512] if args.quick else INT8_BATCHES
    if args.shapes_arg:  # e.g. 4096x11008,1536x576: (1) and (3) on these shapes only
        args.shapes = args.int8_shapes = [parse_shape(s) for s in args.shapes_arg.split(",")]
    if args.batches_arg:
        args.batches = args.int8_batches = [int(b) for b in args.batches_arg.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    args.flush = CacheFlusher(args.flush_mib)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels are unavailable here (no C++ compiler?)")
    info = machine()
    info["revision"] = revision()
    print(f"command: {command_line()}")
    print(f"code: {info['revision']}")
    print(
        f"machine: {info['cpu']}, {info['cpus']} CPUs, torch {info['torch']} with {info['torch_threads']} threads, "
        f"kernels {kernels.isa}; load average at start {' '.join(info['loadavg'] or [])}; {info['date']}"
    )
    scaling = scaling_table(args, gen)
    if args.scaling_only:
        if args.json:
            out = Path(args.json)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(
                json.dumps({"command": command_line(), "machine": info, "scaling": scaling}, indent=2) + "\n"
            )
            print(f"wrote {out}")
        return
    print(f"caches flushed before every timed call: {args.flush_mib} MiB written (untimed)")
    started = time.perf_counter()
    args.copier = Copier()
    copy_bps = copy_bandwidth(args.copier, args.repeats)
    print(
        f"copy bandwidth (torch copy of {COPY_MIB} MiB uint8, read + write bytes / s): {copy_bps / 1e9:.2f} GB/s "
        "at the start; it drifts on this VM, so (1) and (2) time the copy again in every cell's rounds"
    )
    kernel = kernel_table(args, gen)
    isa = isa_table(args, gen)
    int8 = [] if args.skip_int8 else int8_table(args, gen)
    copy_end = copy_bandwidth(args.copier, args.repeats)
    result = summary(kernel, int8)
    loadavg_end = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    print(
        f"\ncopy bandwidth at the end: {copy_end / 1e9:.2f} GB/s (start {copy_bps / 1e9:.2f}); "
        f"load average at the end {' '.join(loadavg_end or [])}; {time.perf_counter() - started:.0f} s"
    )
    if result["big_shapes_batch1_pct_copy_min"] is not None:
        print(
            f"big shapes at batch 1: kernel reads W at {result['big_shapes_batch1_pct_copy_min']:.0f}-"
            f"{max(r['kernel_pct_copy'] for r in kernel if tuple(r['shape']) in BIG_SHAPES and r['batch'] == 1):.0f}"
            f"% of the copy bandwidth (goal >= 50 %); speed-up over fp32, median "
            f"{result['big_shapes_batch1_speedup_median']:.2f}x"
        )
    if int8:
        print(
            f"8-bit LUT: faster in {result['int8_wins']['kernel']} cases the LUT kernel, in "
            f"{result['int8_wins']['int8']} int8 + _weight_int8pack_mm"
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": command_line(),
            "machine": info,
            "kernels_isa": kernels.isa,
            "flush_mib": args.flush_mib,
            "loadavg_end": loadavg_end,
            "copy_bandwidth_bps": {"start": copy_bps, "end": copy_end},
            "scaling": scaling,
            "kernel": kernel,
            "isa": isa,
            "int8": int8,
            "summary": result,
        }
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
