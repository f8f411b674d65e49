"""Launchers for the Triton LUT kernels: ``lut_linear`` (GEMV for M <= 8, else GEMM) and ``lut_dequantize``.

Importing this module does not import triton; the first launch does (``ImportError`` if it is missing,
see :func:`squeeze.runtime.kernels.triton_available`). With ``TRITON_INTERPRET=1`` in the environment
before that first launch, the kernels run in Triton's interpreter on CPU tensors (the tests do this).

Tiling (defaults below; ``scripts/gpu_check.py`` sweeps alternatives on a GPU and reports the best):
* GEMV: each program owns BLOCK_R output rows and loops over the code tiles (CPG*T columns each) with
  a (BLOCK_M, BLOCK_R, T) float32 accumulator; BLOCK_R shrinks as M grows to keep it in registers.
  Split-K (several programs per row block, float32 atomics) only when there are too few row blocks to
  fill the GPU.
* GEMM: BLOCK_M x BLOCK_N output tiles; per K step CPG tl.dot calls with K = T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from squeeze.errors import ConfigError
from squeeze.quant.qweight import LutWeight
from squeeze.runtime.kernels.layout import GROUPS, PreparedLut, prepare

#: Largest batch (rows of x) that takes the GEMV path.
GEMV_MAX_M = 8
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    """Decode GEMV tiling: rows per program, warps, K splits, LUT lookup from registers (tl.gather) or
    from the L1-cached LUT rows (tl.load), sparse entries per row per step."""

    block_r: int = 16
    num_warps: int = 4
    split_k: int = 1
    lut_gather: bool = False
    sparse_block: int = 16


@dataclass(frozen=True)
class GemmConfig:
    """Prefill GEMM tiling: output tile, groups per tl.dot (a power of two, at most the layout's tile T),
    warps, pipelining depth, grouped ordering, sparse entries per step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2
    group_m: int = 8
    sparse_block: int = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # the interpreter: any small number


def default_gemv_config(prepared: PreparedLut, m: int) -> GemvConfig:
    """Heuristic GEMV tiling for ``m`` (<= 8) activation rows."""
    block_m = _pow2_at_least(m)
    sms = _sm_count(prepared.device)
    # the (BLOCK_M, BLOCK_R, T) accumulator: at most ~32 float32 registers per thread at 4 warps
    limit = max(2, min(32, 4096 // (block_m * prepared.tile)))
    # at least ~2 row blocks per SM where the rows allow it (down to 8 rows per block) ...
    block_r = 8
    while block_r * 2 <= limit and prepared.out_features // (block_r * 2) >= 2 * sms:
        block_r *= 2
    block_r = min(block_r, limit)
    # ... and split K when there are still too few (narrow layers such as GQA's k/v projections)
    blocks = _cdiv(prepared.out_features, block_r)
    split_k = 1
    while blocks * split_k < 2 * sms and split_k < 8 and prepared.n_tiles >= 8 * split_k:
        split_k *= 2
    return GemvConfig(block_r=block_r, split_k=split_k)


def default_gemm_config(prepared: PreparedLut, m: int, dtype: torch.dtype) -> GemmConfig:
    """Heuristic GEMM tiling for ``m`` (> 8) activation rows."""
    block_m = max(16, min(128, _pow2_at_least(m)))
    if dtype == torch.float32:  # float32 tiles take twice the registers
        return GemmConfig(block_m=min(block_m, 64), block_n=64, num_warps=4)
    return GemmConfig(block_m=block_m, block_n=128 if block_m >= 64 else 64, num_warps=8 if block_m >= 64 else 4)


def lut_linear(
    x: Tensor,
    weight: LutWeight | PreparedLut,
    bias: Tensor | None = None,
    *,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
) -> Tensor:
    """(..., R) in x.dtype: ``x (..., N) @ W^T + bias`` by the Triton LUT kernels.

    ``weight``: a PreparedLut on x's device (from :func:`~squeeze.runtime.kernels.layout.prepare`, once
    per weight), or a LutWeight, prepared on every call (convenient, slow). x: float16, bfloat16 or
    float32; accumulation is float32. M = prod(x.shape[:-1]) <= 8 runs the GEMV, larger M the GEMM.
    """
    prepared = weight if isinstance(weight, PreparedLut) else prepare(weight, x.device)
    n, r = prepared.in_features, prepared.out_features
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != n:
        raise ConfigError(f"x must have shape (..., {n}), found {tuple(x.shape) if isinstance(x, Tensor) else x}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"x must be float16, bfloat16 or float32, found {x.dtype}")
    if x.device != prepared.device:
        raise ConfigError(f"x is on {x.device} but the prepared weight is on {prepared.device}")
    if bias is not None:
        if bias.shape != (r,):
            raise ConfigError(f"bias must have shape ({r},), found {tuple(bias.shape)}")
        bias = bias.to(x.device).contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), n)  # (M, N); not -1: M or N may be 0
    if n and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0 or r == 0 or n == 0:  # nothing to launch: the product is empty or zero
        out = torch.zeros(m, r, dtype=x.dtype, device=x.device)
        if bias is not None and m:
            out += bias.to(x.dtype)
        return out.reshape(*lead, r)
    if m <= GEMV_MAX_M:
        out = _launch_gemv(x2, prepared, bias, gemv or default_gemv_config(prepared, m))
    else:
        out = _launch_gemm(x2, prepared, bias, gemm or default_gemm_config(prepared, m, x.dtype))
    return out.reshape(*lead, r)


def lut_dequantize(prepared: PreparedLut, dtype: torch.dtype = torch.float16, block_r: int = 16) -> Tensor:
    """(R, N) in ``dtype``: the exact dequantized weight (LUT values by a Triton kernel, then the sparse
    values REPLACE theirs, as the format says), for a dense fallback such as dequantize + cuBLAS."""
    from squeeze.runtime.kernels import _triton_kernels as K

    r, n = prepared.out_features, prepared.in_features
    out = torch.empty(r, n, dtype=dtype, device=prepared.device)
    if r and n:
        cpg, bpg = GROUPS[prepared.bits]
        grid = (_cdiv(r, block_r), prepared.n_tiles)
        K._lut_dequant_kernel[grid](
            prepared.codes, prepared.lut, out, r, n, prepared.n_tiles, out.stride(0),
            BITS=prepared.bits, CPG=cpg, BPG=bpg, T=prepared.tile, L=1 << prepared.bits, BLOCK_R=block_r,
        )
    if prepared.resid is not None:
        # additive residual -> replaced value: float32 lut + (v - lut), then ONE rounding to dtype (adding
        # to the already rounded dense value would round twice)
        rows, cols = prepared.sparse_positions()
        lut_at = prepared.lut[rows, prepared.codes_at(rows, cols)]  # (nnz,) float32
        out[rows, cols] = (lut_at + prepared.resid).to(dtype)
    return out


def _sparse_args(prepared: PreparedLut) -> tuple[Tensor, Tensor, Tensor]:
    if prepared.resid is None:
        # never read (HAS_SPARSE=False), but the kernel signature needs tensors
        return prepared.lut, prepared.lut, prepared.lut
    return prepared.rowptr, prepared.cols, prepared.resid  # type: ignore[return-value]


def _common_meta(prepared: PreparedLut) -> dict[str, Any]:
    cpg, bpg = GROUPS[prepared.bits]
    return {"BITS": prepared.bits, "CPG": cpg, "BPG": bpg, "T": prepared.tile, "L": 1 << prepared.bits}


def _launch_gemv(x2: Tensor, prepared: PreparedLut, bias: Tensor | None, cfg: GemvConfig) -> Tensor:
    from squeeze.runtime.kernels import _triton_kernels as K

    m, r = x2.shape[0], prepared.out_features
    split_k = max(1, min(cfg.split_k, prepared.n_tiles))
    tiles_per_split = _cdiv(prepared.n_tiles, split_k)
    split_k = _cdiv(prepared.n_tiles, tiles_per_split)  # no empty splits
    atomic = split_k > 1
    # split-K partials meet in a zeroed float32 buffer (atomics); otherwise store x's dtype directly
    out = torch.zeros(m, r, dtype=torch.float32, device=x2.device) if atomic else torch.empty(
        m, r, dtype=x2.dtype, device=x2.device)
    rowptr, cols, resid = _sparse_args(prepared)
    grid = (_cdiv(r, cfg.block_r), split_k)
    K._lut_gemv_kernel[grid](
        x2, prepared.codes, prepared.lut, rowptr, cols, resid, bias if bias is not None else prepared.lut, out,
        m, r, prepared.in_features, prepared.n_tiles, tiles_per_split, x2.stride(0), out.stride(0),
        BLOCK_M=_pow2_at_least(m), BLOCK_R=cfg.block_r, SP=cfg.sparse_block,
        HAS_SPARSE=prepared.has_sparse, HAS_BIAS=bias is not None, ATOMIC=atomic, LUT_GATHER=cfg.lut_gather,
        num_warps=cfg.num_warps, **_common_meta(prepared),
    )
    return out.to(x2.dtype) if atomic else out


def _launch_gemm(x2: Tensor, prepared: PreparedLut, bias: Tensor | None, cfg: GemmConfig) -> Tensor:
    from squeeze.runtime.kernels import _triton_kernels as K

    m, r = x2.shape[0], prepared.out_features
    out = torch.empty(m, r, dtype=x2.dtype, device=x2.device)
    rowptr, cols, resid = _sparse_args(prepared)
    grid = (_cdiv(m, cfg.block_m) * _cdiv(r, cfg.block_n),)
    K._lut_gemm_kernel[grid](
        x2, prepared.codes, prepared.lut, rowptr, cols, resid, bias if bias is not None else prepared.lut, out,
        m, r, prepared.in_features, prepared.n_tiles, x2.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k, prepared.tile), GROUP_M=cfg.group_m,
        SP=cfg.sparse_block,
        HAS_SPARSE=prepared.has_sparse, HAS_BIAS=bias is not None, FP32_DOT=x2.dtype == torch.float32,
        # CPU tensors only run under TRITON_INTERPRET=1, whose tl.dot cannot take bfloat16
        DOT_UPCAST=x2.device.type == "cpu" and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_common_meta(prepared),
    )
    return out


__all__ = [
    "GEMV_MAX_M", "GemvConfig", "GemmConfig", "default_gemv_config", "default_gemm_config",
    "lut_linear", "lut_dequantize",
]
