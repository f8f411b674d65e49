"""Tiling of the Triton LUT kernels: the config dataclasses and the default heuristics.

The defaults are educated guesses from the kernels' register use (checked offline with
``scripts/device/gpu_check.py --compile-only``); ``scripts/device/gpu_check.py`` times alternatives on a GPU and prints
the best, so these numbers are the place to tune.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from squeeze.runtime.kernels.layout import GROUPS, PreparedLut

#: Largest batch (rows of x) that takes the GEMV path.
GEMV_MAX_M = 8
#: From this many rows of x on, "auto" prefill dequantizes the weight (Triton) and calls torch.matmul
#: (cuBLAS) instead of the fused LUT GEMM: the dense GEMM's speed then outweighs the extra 2 bytes per
#: weight written and read.
DEQUANT_MIN_M = 256


@dataclass(frozen=True)
class GemvConfig:
    """Decode GEMV tiling: rows per program, warps, how far the code loads run ahead (``prefetch``: tiles
    held in registers, 1 or 2; 0 hands the loop to Triton's pipeliner with ``num_stages``), K splits,
    sparse entries per row per step, and for M > 1 whether products run on the tensor cores (``mma``:
    tl.dot on a weight tile rounded to x's dtype, block_r >= 16) or elementwise in float32."""

    block_r: int = 16
    num_warps: int = 4
    prefetch: int = 2
    num_stages: int = 1
    split_k: int = 1
    sparse_block: int = 16
    mma: bool = True


@dataclass(frozen=True)
class GemmConfig:
    """Prefill tiling. Fused GEMM: output tile, groups per tl.dot (a power of two <= the layout's tile T),
    warps, pipelining depth, grouped ordering. Sparse SpMM: rows and activation rows per program, entries
    per step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2
    group_m: int = 8
    spmm_block_r: int = 8
    spmm_block_m: int = 64
    sparse_block: int = 8


def pow2_at_least(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (a small stand-in for the CPU interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def default_gemv_config(prepared: PreparedLut, m: int) -> GemvConfig:
    """Heuristic GEMV tiling for ``m`` (<= 8) activation rows."""
    sms = sm_count(prepared.device)
    if m == 1:
        # a (BLOCK_R, T) float32 accumulator: at most ~32 registers per thread at 4 warps
        limit = max(2, min(32, 4096 // prepared.tile))
        block_r = 8
        # at least ~2 row blocks per SM where the rows allow it ...
        while block_r * 2 <= limit and prepared.out_features // (block_r * 2) >= 2 * sms:
            block_r *= 2
        block_r = min(block_r, limit)
    else:
        block_r = 16  # tl.dot's smallest tile; one tile of prefetch keeps it under 255 registers
    # ... and split K when there are too few (narrow layers such as GQA's k/v projections)
    blocks = -(-prepared.out_features // block_r)
    split_k = 1
    while blocks * split_k < 2 * sms and split_k < 8 and prepared.n_tiles >= 2 * split_k:
        split_k *= 2
    return GemvConfig(block_r=block_r, split_k=split_k, prefetch=2 if m == 1 else 1)


def default_gemm_config(prepared: PreparedLut, m: int, dtype: torch.dtype) -> GemmConfig:
    """Heuristic fused-GEMM tiling for ``m`` (> 8) activation rows."""
    block_m = max(16, min(128, pow2_at_least(m)))
    # CPG tl.dot calls per K step each keep their operand tiles in shared memory: K x CPG <= 64 keeps a
    # 128 x 128 tile at 72 KB (4 bits) / 136 KB (3 bits), under the 227 KB a block may have
    block_k = min(prepared.tile, max(16, 64 // GROUPS[prepared.bits][0]))
    if dtype == torch.float32:  # float32 tiles take twice the registers
        return GemmConfig(block_m=min(block_m, 64), block_n=64, block_k=block_k, num_warps=4)
    return GemmConfig(
        block_m=block_m, block_n=128 if block_m >= 64 else 64, block_k=block_k, num_warps=8 if block_m >= 64 else 4
    )


__all__ = [
    "GEMV_MAX_M",
    "DEQUANT_MIN_M",
    "GemvConfig",
    "GemmConfig",
    "default_gemv_config",
    "default_gemm_config",
    "pow2_at_least",
    "sm_count",
]
