"""The native CPU LUT kernels from Python: a weight's prepared form, and ``y = x @ W^T + b`` through it.

With ``activations="int8"``, 3- and 4-bit weights run the W4A8 kernel (:mod:`.cpu_w8`) at every
number of rows: one batch-invariant path. With ``activations="float32"`` (the default; and at other widths):
Decode and small batches (at most GEMV_MAX_ROWS rows of x): a fused GEMV reads the codes once per 8 rows of x.
Prefill (more rows): row tiles of W are dequantized into a reused float32 buffer of about 4 MiB and
multiplied by torch's GEMM (compute-bound there; oneDNN/MKL do it well), so the dense weight never exists.

Memory: the codes and the LUT ARE the module's own buffers (read in place, no copy); with a sparse part the
prepared form adds 12 bytes per sparse entry (position, exact value as float32, residual); the int8 form
(:mod:`.cpu_w8`) 20 bytes per row and 8 per sparse entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.schemes.lut import Lut8Weight, LutWeight
from squeeze.runtime.kernels.cpu_build import CpuKernels, PreparedWeight, SqWeight, cpu_kernels
from squeeze.runtime.kernels.cpu_w8 import DEFAULT_ACTIVATIONS, Activations, W8Prepared, bias_f32, prepare_w8, w8_linear
from squeeze.runtime.kernels.reference import sparse_residual

#: Rows of x up to which the fused GEMV runs (in chunks of 8 rows, each chunk reading W once); above, the
#: dequantize-a-tile + GEMM path. Caches flushed, 4-bit: at 12-32 rows the GEMV takes 0.3-0.8x the tile
#: path's time on 1536x576, 576x1536 and 4096x4096 (and beats fp32 F.linear on all three).
GEMV_MAX_ROWS = 32
#: float32 elements of one dequantized tile of W (4 MiB), and the fewest rows a tile holds: torch's GEMM
#: needs tall enough tiles (4096x11008 at 512 tokens, scripts/bench/bench_cpu_kernels.py: 1 MiB tiles of 23 rows
#: ran at 0.5x fp32; 4 MiB tiles of at least 128 rows at 0.83x).
TILE_ELEMENTS = 1 << 20
TILE_MIN_ROWS = 128
#: Fewest rows the tile path multiplies at once: torch's float32 GEMM gives each row the same bits at any
#: batch of 16 rows or more (measured on this machine kind's torch 2.13: 8 rows differ from 16), so fewer
#: rows are padded with zeros up to it (see :func:`row_paths`).
TILED_MIN_ROWS = 16
#: cpu_lut.cpp's LUT kinds (sq_weight.lut_kind).
LUT_F32, LUT_F16, LUT_U8_AFFINE = 0, 1, 2
#: Code widths whose blocks the SIMD paths decode (others run the kernels' scalar path).
SIMD_BITS = {4: 2, 3: 8}  # bits -> codes per group; a block is 16 groups


@dataclass(frozen=True, eq=False)
class CpuPreparedLut(PreparedWeight):
    """A LutWeight as the native kernels read it. ``keep`` holds every tensor ``weight`` points into."""

    kernels: CpuKernels
    weight: SqWeight
    keep: tuple[Tensor, ...]
    rows: int
    in_features: int
    bits: int
    #: bytes held beyond the module's own buffers: the sparse part's kernel form (positions, values,
    #: residuals), a float32 LUT only for LUT dtypes the kernels do not read in place, the int8 form
    extra_bytes: int = 0
    #: the int8 (W4A8) form, which every call then runs; None: the float32 kernels
    w8: W8Prepared | None = None

    @property
    def activations(self) -> Activations:
        """The activation precision the calls run: int8 when the weight has an int8 form, else float32."""
        return "int8" if self.w8 is not None else "float32"


def covers(qweight: object) -> bool:
    """True when the native kernels run this weight: a LUT format (fp16 or 8-bit LUT) on the CPU."""
    return isinstance(qweight, LutWeight) and qweight.packed.device.type == "cpu"


def prepare_cpu(
    qweight: LutWeight, kernels: CpuKernels | None = None, activations: Activations = DEFAULT_ACTIVATIONS
) -> CpuPreparedLut | None:
    """The kernels' form of ``qweight`` (None when the kernels are unavailable or do not cover it).

    ``kernels``: a specific build or instruction set (tests pin one with :meth:`CpuKernels.with_isa`);
    default: this machine's, built on first use. ``activations``: "int8" adds the W4A8 form (3 and 4 bits),
    which every call then runs; "float32" keeps the exact float32 kernels (:mod:`.cpu_w8`).
    """
    if not covers(qweight):
        return None
    kernels = kernels or cpu_kernels()
    if kernels is None:
        return None
    packed = qweight.packed.contiguous()  # (R, ceil(N * bits / 8)) uint8: the module's buffer, no copy
    lut, lut_kind, scale, zero = _lut_in_place(qweight)
    rows, n, bits = qweight.out_features, qweight.in_features, qweight.bits
    keep: list[Tensor] = [t for t in (packed, lut, scale, zero) if t is not None]
    sparse_ptrs: list[int | None] = [None, None, None, None]
    if qweight.sparse is not None and qweight.sparse.nnz:
        sparse = qweight.sparse
        _, cols, resid = sparse_residual(qweight)  # (nnz,) int32 columns, float32 exact - LUT value
        vals = sparse.vals.to(torch.float32).contiguous()  # (nnz,) exact values (the tiles' replace)
        rowptr = sparse.rowptr.to(torch.int32).contiguous()  # (R+1,): the module's own, no copy
        pcols = permuted_positions(cols.to(torch.int64), n, bits).to(torch.int32).contiguous()  # (nnz,)
        keep += [rowptr, pcols, resid, vals]
        sparse_ptrs = [t.data_ptr() for t in (rowptr, pcols, resid, vals)]
    weight = SqWeight(
        packed.data_ptr(),
        lut.data_ptr(),
        scale.data_ptr() if scale is not None else None,
        zero.data_ptr() if zero is not None else None,
        *sparse_ptrs,
        rows,
        n,
        int(packed.shape[1]) if rows else 0,
        bits,
        lut_kind,
    )
    own = {t.untyped_storage().data_ptr() for t in qweight.tensors_by_role().values()}
    extra = sum(t.numel() * t.element_size() for t in keep if t.untyped_storage().data_ptr() not in own)
    w8 = prepare_w8(qweight, packed) if activations == "int8" else None
    return CpuPreparedLut(
        kernels=kernels,
        weight=weight,
        keep=tuple(keep),
        rows=rows,
        in_features=n,
        bits=bits,
        extra_bytes=extra + (w8.extra_bytes if w8 is not None else 0),
        w8=w8,
    )


def _lut_in_place(qweight: LutWeight) -> tuple[Tensor, int, Tensor | None, Tensor | None]:
    """(lut, kind, scale, zero) as the kernels read them: the weight's own LUT tensors where their dtypes are
    the kernels' (float16 values; uint8 levels with float16 scale/zero), else a float32 copy of the values."""
    if isinstance(qweight, Lut8Weight) and qweight.lut.dtype == torch.uint8:
        scale, zero = qweight.lut_scale, qweight.lut_zero
        if scale.dtype == zero.dtype == torch.float16:
            return qweight.lut.contiguous(), LUT_U8_AFFINE, scale.contiguous(), zero.contiguous()
    elif qweight.lut.dtype in (torch.float16, torch.float32):
        kind = LUT_F16 if qweight.lut.dtype == torch.float16 else LUT_F32
        return qweight.lut.contiguous(), kind, None, None
    return qweight.lut_values(torch.float32).contiguous(), LUT_F32, None, None


@dataclass(frozen=True)
class RowPlan:
    """Which path each of ``rows`` rows of x takes: ``tiled`` (int64 indices) the tile path, the rest the GEMV."""

    rows: int
    tiled: Tensor
    gemv: Tensor


_ROW_PLAN: ContextVar[RowPlan | None] = ContextVar("squeeze_row_plan", default=None)


@contextmanager
def row_paths(plan: RowPlan | None) -> Iterator[None]:
    """Within the block, linears called with ``plan.rows`` rows of x send each row down the path ``plan`` names.

    The two paths sum in different orders, and the tile path's GEMM (at TILED_MIN_ROWS rows or more) and the
    GEMV give each row the same bits whatever else is in the batch. So a caller that knows where a row would
    have gone when computed alone (squeeze serve: prompt tokens of a prompt longer than GEMV_MAX_ROWS take the
    tile path, as in ``squeeze run``'s prefill; everything else the GEMV) gets exactly that row's bits.
    """
    token = _ROW_PLAN.set(plan)
    try:
        yield
    finally:
        _ROW_PLAN.reset(token)


def serving_step() -> bool:
    """Whether a :func:`row_paths` block is active (a serving step: every row must get its batch-free bits)."""
    return _ROW_PLAN.get() is not None


def cpu_lut_linear(x: Tensor, prepared: CpuPreparedLut, bias: Tensor | None = None) -> Tensor:
    """(..., R) in x.dtype: ``x (..., N) @ W^T + bias`` by the native kernels.

    The int8 form (``prepared.w8``) runs every row count, batch-invariant by construction (a :func:`row_paths`
    plan is then moot). Float32: up to GEMV_MAX_ROWS rows of x run the GEMV, more the tile path, unless
    :func:`row_paths` says otherwise.
    """
    lead, n, rows = x.shape[:-1], prepared.in_features, prepared.rows
    x2 = x.reshape(lead.numel(), n)  # (B, N); not -1: N may be 0
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    batch = int(x2.shape[0])
    plan = _ROW_PLAN.get()
    if prepared.w8 is not None:
        y = w8_linear(x2, prepared.w8, prepared.kernels, bias)
    elif plan is not None and plan.rows == batch and plan.tiled.numel():
        y = torch.empty(batch, rows, dtype=torch.float32)  # (B, R)
        y[plan.tiled] = _tiled_rows(x2[plan.tiled], prepared, bias)
        if plan.gemv.numel():
            y[plan.gemv] = _gemv(x2[plan.gemv], prepared, bias)
    elif batch <= GEMV_MAX_ROWS or plan is not None:
        y = _gemv(x2, prepared, bias)
    else:
        y = _tiled_rows(x2, prepared, bias)
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).reshape(*lead, rows)


def _gemv(x2: Tensor, prepared: CpuPreparedLut, bias: Tensor | None) -> Tensor:
    """Decode: float32 (B, R), permute, GEMV and bias in one call (one ctypes crossing per linear)."""
    batch, rows = int(x2.shape[0]), prepared.rows
    y = torch.empty(batch, rows, dtype=torch.float32)  # (B, R)
    if batch and rows:
        b32 = bias_f32(bias)
        prepared.kernels.lib.sq_linear(
            prepared.weight_ref,
            x2.data_ptr(),
            batch,
            y.data_ptr(),
            b32.data_ptr() if b32 is not None else None,
            prepared.kernels.isa_code,
            torch.get_num_threads(),
        )
    return y


def _tiled_rows(x2: Tensor, prepared: CpuPreparedLut, bias: Tensor | None) -> Tensor:
    """Prefill: float32 (B, R) through the tile path, x padded with zero rows up to TILED_MIN_ROWS."""
    batch = int(x2.shape[0])
    if batch < TILED_MIN_ROWS:
        x2 = torch.cat([x2, x2.new_zeros(TILED_MIN_ROWS - batch, x2.shape[1])])
    y = _tiled_linear(x2.contiguous(), prepared, torch.get_num_threads())[:batch]
    if bias is not None:
        y += bias.to(torch.float32)
    return y


def _tiled_linear(x2: Tensor, prepared: CpuPreparedLut, threads: int) -> Tensor:
    """Prefill: float32 (B, R) = x2 (B, N) @ W^T, W dequantized one row tile at a time (never whole)."""
    lib, isa, n, rows, batch = (
        prepared.kernels.lib,
        prepared.kernels.isa_code,
        prepared.in_features,
        prepared.rows,
        int(x2.shape[0]),
    )
    xp = torch.empty_like(x2)  # (B, N): x in the kernels' column order
    lib.sq_permute_x(x2.data_ptr(), xp.data_ptr(), batch, n, prepared.bits)
    y_t = torch.empty(rows, batch, dtype=torch.float32)  # (R, B): row tiles of W give contiguous row slices
    tile_rows = max(1, min(rows, max(TILE_MIN_ROWS, TILE_ELEMENTS // max(n, 1))))
    tile = torch.empty(tile_rows, n, dtype=torch.float32)  # (tile_rows, N), reused
    for start in range(0, rows, tile_rows):
        stop = min(start + tile_rows, rows)
        lib.sq_dequant_rows(prepared.weight_ref, start, stop, tile.data_ptr(), isa, threads)
        torch.mm(tile[: stop - start], xp.T, out=y_t[start:stop])  # (rows, N) @ (N, B)
    return y_t.T.contiguous()


def permuted_positions(cols: Tensor, n: int, bits: int) -> Tensor:
    """Positions of columns ``cols`` (int64) in the kernels' column order (cpu_lut.cpp's header comment)."""
    cpg = SIMD_BITS.get(bits)
    if cpg is None:
        return cols.clone()
    span = 16 * cpg
    j = cols % span
    pos = torch.where(cols < (n // span) * span, (cols - j) + (j % cpg) * 16 + j // cpg, cols)
    half = (n // span) * span
    if bits == 3 and n - half >= 64:  # the half block: 8 groups, position 8*s + i
        j = cols - half
        pos = torch.where((j >= 0) & (j < 64), half + (j % 8) * 8 + j // 8, pos)
    return pos


__all__ = [
    "CpuPreparedLut",
    "GEMV_MAX_ROWS",
    "TILED_MIN_ROWS",
    "RowPlan",
    "row_paths",
    "serving_step",
    "covers",
    "prepare_cpu",
    "cpu_lut_linear",
    "permuted_positions",
]
