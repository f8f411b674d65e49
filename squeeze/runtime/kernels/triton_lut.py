"""Launchers for the Triton LUT kernels: ``lut_linear`` and ``lut_dequantize``.

Importing this module does not import triton; the first launch does (``ImportError`` if it is missing,
see :func:`squeeze.runtime.kernels.triton_available`). With ``TRITON_INTERPRET=1`` in the environment
before that first launch, the kernels run in Triton's interpreter on CPU tensors (the tests do this).

Paths of ``lut_linear`` by M, the number of activation rows:
* M <= 8 (decode): one fused GEMV launch: LUT codes, additive sparse residual and bias. Each program owns
  BLOCK_R output rows and loops over the code tiles, the codes of the next tiles prefetched in registers;
  one activation row accumulates elementwise in float32, several on the tensor cores (tl.dot, rows
  padded to 16); split-K (float32 atomics into a zeroed buffer, then a cast) only when the layer has too
  few row blocks to fill the GPU.
* 8 < M < DEQUANT_MIN_M ("fused"): a Triton CSR SpMM writes the sparse part (float32, from x^T so its
  gathers are contiguous) and the LUT GEMM (tl.dot on tiles decoded in registers) adds it and the bias
  before its single rounding.
* M >= DEQUANT_MIN_M ("dequant"): the weight is dequantized exactly into a temporary (R, N) tensor of x's
  dtype (Triton), sparse values replacing theirs, then torch's matmul (cuBLAS) runs at full speed.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from squeeze.quant.schemes.lut import LutWeight
from squeeze.runtime.kernels.configs import (
    DEQUANT_MIN_M,
    GEMV_MAX_M,
    GemmConfig,
    GemvConfig,
    default_gemm_config,
    default_gemv_config,
    pow2_at_least,
)
from squeeze.runtime.kernels.layout import GROUPS, PreparedLut, prepare

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Prefill = Literal["auto", "fused", "dequant"]


def lut_linear(
    x: Tensor,
    weight: LutWeight | PreparedLut,
    bias: Tensor | None = None,
    *,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
    prefill: Prefill = "auto",
) -> Tensor:
    """(..., R) in x.dtype: ``x (..., N) @ W^T + bias`` by the Triton LUT kernels.

    ``weight``: a PreparedLut on x's device (from :func:`~squeeze.runtime.kernels.layout.prepare`, once
    per weight), or a LutWeight, prepared on every call (convenient, slow). x: float16, bfloat16 or
    float32; accumulation is float32. ``prefill`` picks the path for M > 8 (module docstring).
    """
    prepared = weight if isinstance(weight, PreparedLut) else prepare(weight, x.device)
    n, r = prepared.in_features, prepared.out_features
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != n:
        raise ValueError(f"x must have shape (..., {n}), found {tuple(x.shape) if isinstance(x, Tensor) else x}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, found {x.dtype}")
    if x.device != prepared.device:
        raise ValueError(f"x is on {x.device} but the prepared weight is on {prepared.device}")
    if prefill not in ("auto", "fused", "dequant"):
        raise ValueError(f"prefill must be 'auto', 'fused' or 'dequant', found {prefill!r}")
    if bias is not None:
        if bias.shape != (r,):
            raise ValueError(f"bias must have shape ({r},), found {tuple(bias.shape)}")
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
    elif prefill == "dequant" or (prefill == "auto" and m >= DEQUANT_MIN_M):
        out = F.linear(x2, lut_dequantize(prepared, x2.dtype), bias)
    else:
        out = _launch_gemm(x2, prepared, bias, gemm or default_gemm_config(prepared, m, x.dtype))
    return out.reshape(*lead, r)


def lut_dequantize(prepared: PreparedLut, dtype: torch.dtype = torch.float16, block_r: int = 16) -> Tensor:
    """(R, N) in ``dtype``: the exact dequantized weight (LUT values by a Triton kernel, then the sparse
    values REPLACE theirs, as the format says), e.g. for dequantize + cuBLAS."""
    from squeeze.runtime.kernels import _triton_kernels as K

    r, n = prepared.out_features, prepared.in_features
    out = torch.empty(r, n, dtype=dtype, device=prepared.device)
    if r and n:
        grid = (_cdiv(r, block_r), prepared.n_tiles)
        K._lut_dequant_kernel[grid](
            prepared.codes,
            prepared.lut,
            out,
            r,
            n,
            prepared.n_tiles,
            out.stride(0),
            BLOCK_R=block_r,
            **_common_meta(prepared),
        )
    if prepared.resid is not None:
        # additive residual -> replaced value: float32 lut + (v - lut), then ONE rounding to dtype (adding
        # to the already rounded dense value would round twice)
        rows, cols = prepared.sparse_positions()
        lut_at = prepared.lut[rows, prepared.codes_at(rows, cols)]  # (nnz,) float32
        out[rows, cols] = (lut_at + prepared.resid).to(dtype)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_meta(prepared: PreparedLut) -> dict[str, Any]:
    cpg, bpg = GROUPS[prepared.bits]
    return {"BITS": prepared.bits, "CPG": cpg, "BPG": bpg, "T": prepared.tile, "L": 1 << prepared.bits}


def _dot_meta(x2: Tensor) -> dict[str, bool]:
    # CPU tensors only run under TRITON_INTERPRET=1, whose tl.dot cannot take bfloat16
    return {"FP32_DOT": x2.dtype == torch.float32, "DOT_UPCAST": x2.device.type == "cpu" and x2.dtype == torch.bfloat16}


def _launch_gemv(x2: Tensor, prepared: PreparedLut, bias: Tensor | None, cfg: GemvConfig) -> Tensor:
    from squeeze.runtime.kernels import _triton_kernels as K

    if cfg.prefetch not in (0, 1, 2):
        raise ValueError(f"GemvConfig.prefetch must be 0, 1 or 2, found {cfg.prefetch}")
    m, r = x2.shape[0], prepared.out_features
    split_k = max(1, min(cfg.split_k, prepared.n_tiles))
    tiles_per_split = _cdiv(prepared.n_tiles, split_k)
    split_k = _cdiv(prepared.n_tiles, tiles_per_split)  # no empty splits
    atomic = split_k > 1
    # split-K partials meet in a zeroed float32 buffer (atomics); otherwise store x's dtype directly
    out = (
        torch.zeros(m, r, dtype=torch.float32, device=x2.device)
        if atomic
        else torch.empty(m, r, dtype=x2.dtype, device=x2.device)
    )
    dummy = prepared.lut  # stands in for absent tensors: never read (HAS_SPARSE / HAS_BIAS False)
    # accumulation: elementwise for one row; for several, tensor cores (tl.dot needs 16 x 16 tiles: the
    # activation rows are padded to 16 by repeating the last one) or elementwise in 3-D
    mode = 0 if m == 1 else 2 if cfg.mma else 1
    block_m = 1 if m == 1 else max(16, pow2_at_least(m)) if mode == 2 else pow2_at_least(m)
    block_r = max(16, cfg.block_r) if mode == 2 else cfg.block_r
    grid = (_cdiv(r, block_r), split_k)
    K._lut_gemv_kernel[grid](
        x2,
        prepared.codes,
        prepared.lut,
        prepared.rowptr if prepared.has_sparse else dummy,
        prepared.cols if prepared.has_sparse else dummy,
        prepared.resid if prepared.has_sparse else dummy,
        bias if bias is not None else dummy,
        out,
        m,
        r,
        prepared.in_features,
        prepared.n_tiles,
        tiles_per_split,
        x2.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        SP=cfg.sparse_block,
        HAS_SPARSE=prepared.has_sparse,
        HAS_BIAS=bias is not None,
        ATOMIC=atomic,
        PREFETCH=cfg.prefetch,
        NUM_STAGES=cfg.num_stages,
        MODE=mode,
        **_dot_meta(x2),
        num_warps=cfg.num_warps,
        **_common_meta(prepared),
    )
    return out.to(x2.dtype) if atomic else out


def _launch_gemm(x2: Tensor, prepared: PreparedLut, bias: Tensor | None, cfg: GemmConfig) -> Tensor:
    from squeeze.runtime.kernels import _triton_kernels as K

    m, r = x2.shape[0], prepared.out_features
    dummy = prepared.lut  # stands in for absent tensors: never read
    sparse = dummy
    if prepared.has_sparse:
        xt = x2.t().contiguous()  # (N, M): each sparse entry then gathers one contiguous column of x
        sparse = torch.empty(m, r, dtype=torch.float32, device=x2.device)
        grid_s = (_cdiv(r, cfg.spmm_block_r), _cdiv(m, cfg.spmm_block_m))
        K._csr_spmm_kernel[grid_s](
            xt,
            prepared.rowptr,
            prepared.cols,
            prepared.resid,
            sparse,
            m,
            r,
            BLOCK_R=cfg.spmm_block_r,
            BLOCK_M=cfg.spmm_block_m,
            SP=cfg.sparse_block,
            num_warps=4,
        )
    out = torch.empty(m, r, dtype=x2.dtype, device=x2.device)
    grid = (_cdiv(m, cfg.block_m) * _cdiv(r, cfg.block_n),)
    K._lut_gemm_kernel[grid](
        x2,
        prepared.codes,
        prepared.lut,
        sparse,
        bias if bias is not None else dummy,
        out,
        m,
        r,
        prepared.in_features,
        prepared.n_tiles,
        x2.stride(0),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=min(cfg.block_k, prepared.tile),
        GROUP_M=cfg.group_m,
        HAS_SPARSE=prepared.has_sparse,
        HAS_BIAS=bias is not None,
        **_dot_meta(x2),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_common_meta(prepared),
    )
    return out


__all__ = ["lut_linear", "lut_dequantize", "Prefill"]
