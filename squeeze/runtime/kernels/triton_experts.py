"""Grouped Triton dequantization of the experts a batch routes to (SqueezeExperts on CUDA).

An expert parameter is stored as one LUT weight of shape (E*out, in) (squeeze.runtime.experts): expert e is
rows ``e*out .. (e+1)*out-1``. :func:`dequantize_experts` expands the rows of k selected experts in ONE
kernel launch (grid: expert x row block x column block) straight from the stored row-packed codes (the
on-disk layout of squeeze.quant.packing: LSB-first bit stream per row, so no second copy of the codes is
kept) and a float32 per-row LUT; the sparse part (exact values that REPLACE the LUT value at their
positions) is scattered by torch afterwards, one small CSR slice per selected expert. The result is
bit-identical to the reference ``row_slice(...).dequantize(dtype)``: the same float32 LUT value, rounded
once to ``dtype``, then the sparse values cast to ``dtype``.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the tests). triton is imported, and
the kernel defined, on the first launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.kernels import triton_available

BLOCK_R, BLOCK_N = 16, 64


@dataclass(frozen=True)
class PreparedExperts:
    """The kernel's view of one expert parameter on one device.

    packed: uint8 (E*out, W), the stored codes (the module's own buffer when already contiguous);
    lut: float32 (E*out, 2**bits), each row's LUT values as the format's ``lut_values`` computes them.
    """

    packed: Tensor
    lut: Tensor
    bits: int
    in_features: int


def prepare_experts(qweight: WeightFormat, device: torch.device) -> PreparedExperts | None:
    """The kernel layout of ``qweight`` on ``device``, or None when the kernel does not apply (no triton, a
    format without the LUT kernel family, or meta tensors)."""
    lut_values = getattr(qweight, "lut_values", None)
    if qweight.kernel != "lut" or lut_values is None or qweight.packed.is_meta or not triton_available():
        return None
    return PreparedExperts(
        packed=qweight.packed.to(device).contiguous(),
        lut=lut_values(torch.float32).to(device).contiguous(),  # the reference's float32 values, exactly
        bits=qweight.bits,
        in_features=qweight.in_features,
    )


def dequantize_experts(
    prepared: PreparedExperts, qweight: WeightFormat, ids: Tensor, expert_rows: int, dtype: torch.dtype
) -> Tensor:
    """(k, out, in) in ``dtype``: the experts ``ids`` (int64 (k,), each in [0, E)) of ``qweight``, whose
    experts have ``expert_rows`` rows each, by one grouped kernel launch plus the sparse replacements."""
    k, n = int(ids.numel()), prepared.in_features
    device = prepared.packed.device
    out = torch.empty(k, expert_rows, n, dtype=dtype, device=device)
    if k and expert_rows and n:
        grid = (k, -(-expert_rows // BLOCK_R), -(-n // BLOCK_N))
        _kernel()[grid](
            prepared.packed,
            prepared.lut,
            ids.to(device=device, dtype=torch.int64).contiguous(),
            out,
            expert_rows,
            n,
            prepared.packed.shape[1],
            prepared.lut.shape[1],
            out.stride(0),
            out.stride(1),
            BITS=prepared.bits,
            BLOCK_R=BLOCK_R,
            BLOCK_N=BLOCK_N,
        )
    sparse = getattr(qweight, "sparse", None)
    if sparse is not None:
        for i, e in enumerate(ids.tolist()):
            part = qweight.row_slice(e * expert_rows, (e + 1) * expert_rows)
            if part.sparse is not None and part.sparse.nnz:  # type: ignore[attr-defined]
                part.sparse.scatter_into(out[i])  # type: ignore[attr-defined]  # exact values replace the LUT's
    return out


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use (so TRITON_INTERPRET set by a test before it is honoured)."""
    import triton
    import triton.language as tl

    @triton.jit
    def experts_dequant_kernel(
        packed_ptr,
        lut_ptr,
        ids_ptr,
        out_ptr,
        ROWS,
        N,
        ROW_BYTES,
        LEVELS,
        stride_ok,
        stride_or,
        BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """out[k, r, c] = lut[e*ROWS + r, code(e*ROWS + r, c)] with e = ids[k]. Grid (k, row blocks, col blocks)."""
        k = tl.program_id(0)
        e = tl.load(ids_ptr + k).to(tl.int64)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rows within the expert
        c = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask = (r[:, None] < ROWS) & (c[None, :] < N)
        rows = e * ROWS + r.to(tl.int64)  # rows of the stored (E*out, in) matrix
        bit = c * BITS
        byte = bit // 8
        row_ptrs = packed_ptr + rows[:, None] * ROW_BYTES
        word = tl.load(row_ptrs + byte[None, :], mask=mask, other=0).to(tl.int32)
        if 8 % BITS != 0:  # 3 bits: a code may straddle two bytes
            nxt = mask & ((byte + 1) < ROW_BYTES)[None, :]
            word |= tl.load(row_ptrs + byte[None, :] + 1, mask=nxt, other=0).to(tl.int32) << 8
        code = (word >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
        value = tl.load(lut_ptr + rows[:, None] * LEVELS + code, mask=mask, other=0.0)
        out_ptrs = out_ptr + k.to(tl.int64) * stride_ok + r[:, None].to(tl.int64) * stride_or + c[None, :]
        tl.store(out_ptrs, value.to(out_ptr.dtype.element_ty), mask=mask)

    return experts_dequant_kernel


__all__ = ["PreparedExperts", "prepare_experts", "dequantize_experts"]
