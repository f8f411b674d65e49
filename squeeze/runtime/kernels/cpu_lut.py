"""The native CPU LUT kernels from Python: a weight's prepared form, and ``y = x @ W^T + b`` through it.

One matmul for every number of rows of x (cpu_lut.cpp, ``sq_lut_matmul``): each output is summed in one order
that depends neither on how many rows of x come together nor on the thread count, so a row's result is the same
alone (decoding one sequence: M = 1 is the smallest case, not another kernel), in a serving step's batch and in
a prefill. Each panel of output rows is decoded once per call into a small cache-resident float32 buffer and
multiplied by every row of x in register blocks. With ``activations="int8"``, 3- and 4-bit weights run the
W4A8 kernel (:mod:`.cpu_w8`) instead, batch-invariant by its exact integer sums.

Measured (2026-12-07 13:26 UTC, AMD EPYC Zen 4, 1 thread, 4-bit random codes, microseconds per call of
``cpu_lut_linear``, min of 2 runs x 60 calls beside ~12 other jobs on 2 cores; old = main at 36d08ab (the GEMV up
to 32 rows, tiles above; int8 with per-ROW scales), run in turn with this code; bf16 GEMM = torch F.linear on
the dequantized weight at 32 rows; the same table in-tree: ``scripts/bench/bench_cpu_kernels.py --scaling-only
--threads 1``):

    out x in   form      t(1) new/old   t(16) new/old   t(32) new/old    t16/t1   t32 / bf16 GEMM (us)
    576x576    float32   21.4 / 21.9    144 / 136       261 / 263        6.7      2.06 (126)
    576x576    bfloat16  18.8           113             189              6.0      1.50
    576x576    int8      17.6 / 19.1    60 / 63         104 / 107        3.4      0.82
    192x576    float32   10.7 / 12.2    54 / 53         96 / 99          5.1      1.85 (52)
    192x576    bfloat16   9.9           44              73               4.5      1.40
    192x576    int8      10.3 / 12.4    34 / 39         60 / 65          3.3      1.15
    1536x576   float32   49.8 / 47.4    362 / 345       673 / 682        7.3      2.18 (309)
    1536x576   bfloat16  42.7           283             474              6.6      1.53
    1536x576   int8      38.0 / 38.7    126 / 125       215 / 209        3.3      0.69
    576x1536   float32   43.0 / 44.8    335 / 531       629 / 1066       7.8      2.07 (304)
    576x1536   bfloat16  34.6           246             403              7.1      1.33
    576x1536   int8      37.5 / 30.3    149 / 151       261 / 259        4.0      0.86

So: one path, batch-invariant at every row count, at the old speeds (float32 t(1) within +-12% of the GEMV,
t(32) equal or 1.7x faster). float32 is compute-bound (16 FMAs per cycle): its t16/t1 stays 5-8 and its
t(32) about 2x torch's bf16 GEMM. bfloat16 (vdpbf16ps) is faster than float32 at every row count and 1.3-1.5x
torch's bf16 GEMM at 32 rows. int8 (scales per 64 columns; its rows re-measured at b5ee68c in the same way)
beats torch's bf16 GEMM at 32 rows on three of four shapes (k/v, 192 rows: 1.15x), t16/t1 3.3-4.0 (goal 2.0). Perplexity
of bfloat16 and int8 not measured on an artifact (no SmolLM2 artifact in this session; a torch emulation:
squeeze.runtime.activations): float32 stays the default.

Memory: the codes and the LUT ARE the module's own buffers (read in place, no copy); with a sparse part the
prepared form adds 12 bytes per sparse entry (position, exact value as float32, residual); the int8 form
(:mod:`.cpu_w8`) 20 bytes per row and 8 per sparse entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.schemes.lut import Lut8Weight, LutWeight
from squeeze.runtime.kernels.cpu_build import CpuKernels, PreparedWeight, SqWeight, cpu_kernels
from squeeze.runtime.kernels.cpu_w8 import DEFAULT_ACTIVATIONS, Activations, W8Prepared, bias_f32, prepare_w8
from squeeze.runtime.kernels.reference import sparse_residual

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
    #: the one matmul's bfloat16 form (AVX-512 BF16 only), which every call then runs
    bf16: bool = False

    @property
    def activations(self) -> Activations:
        """The activation precision the calls run: int8 with an int8 form, bfloat16 with the bfloat16 form,
        else float32."""
        return "int8" if self.w8 is not None else ("bfloat16" if self.bf16 else "float32")

    @property
    def packed(self) -> Tensor:
        """The packed codes ``weight`` reads, (R, ceil(N * bits / 8)) uint8 contiguous: ``keep[0]``, the module's
        buffer itself (a copy only if that was not contiguous). An int8 form built from them
        (:func:`.cpu_w8.prepare_w8`) keeps only their address: this form's ``keep`` holds them."""
        return self.keep[0]


def covers(qweight: object) -> bool:
    """True when the native kernels run this weight: a LUT format (fp16 or 8-bit LUT) on the CPU."""
    return isinstance(qweight, LutWeight) and qweight.packed.device.type == "cpu"


def prepare_cpu(
    qweight: LutWeight, kernels: CpuKernels | None = None, activations: Activations = DEFAULT_ACTIVATIONS
) -> CpuPreparedLut | None:
    """The kernels' form of ``qweight`` (None when the kernels are unavailable or do not cover it).

    ``kernels``: a specific build or instruction set (tests pin one with :meth:`CpuKernels.with_isa`);
    default: this machine's, built on first use. ``activations``: "int8" adds the W4A8 form (3 and 4 bits),
    which every call then runs; "bfloat16" runs the one matmul's bfloat16 form where the kernels run AVX-512
    with BF16 (elsewhere float32); "float32" keeps the exact float32 form (:mod:`.cpu_w8`).
    """
    if not covers(qweight):
        return None
    kernels = kernels or cpu_kernels()
    if kernels is None:
        return None
    packed = qweight.packed.contiguous()  # (R, ceil(N * bits / 8)) uint8: the module's buffer, no copy
    lut, lut_kind, scale, zero = _lut_in_place(qweight)
    rows, n, bits = qweight.out_features, qweight.in_features, qweight.bits
    keep: list[Tensor] = [t for t in (packed, lut, scale, zero) if t is not None]  # packed first: .packed
    sparse_ptrs: list[int | None] = [None, None, None, None]
    if qweight.sparse is not None and qweight.sparse.nnz:
        sparse = qweight.sparse
        _, cols, resid = sparse_residual(qweight)  # (nnz,) int32 columns, float32 exact - LUT value
        vals = sparse.vals.to(torch.float32).contiguous()  # (nnz,) exact values (sq_dequant_rows writes them in)
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
        bf16=activations == "bfloat16" and kernels.isa == "avx512" and bool(kernels.lib.sq_bf16_supported()),
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


def cpu_lut_linear(x: Tensor, prepared: CpuPreparedLut, bias: Tensor | None = None) -> Tensor:
    """(..., R) in x.dtype: ``x (..., N) @ W^T + bias`` by the native kernels, in one call at every row count.

    Float32 activations: the one matmul (module docstring), its sums within float32 rounding of the
    reference's and each row's bits independent of the batch; bfloat16: its bfloat16 form (operands rounded
    to bfloat16, float32 sums, batch-invariant too); int8 (``prepared.w8``): the W4A8 kernel.
    """
    lead, rows = x.shape[:-1], prepared.rows
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    # (..., N) contiguous is (M, N) in memory and (..., R) is (M, R): no reshapes (a decode step makes ~200
    # calls of a few microseconds each, and two reshapes cost about 2.5 us)
    y = torch.empty((*lead, rows), dtype=torch.float32)
    batch = y.numel() // rows if rows else 0
    if batch:
        b32 = bias_f32(bias)
        lib, bias_ptr = prepared.kernels.lib, b32.data_ptr() if b32 is not None else None
        threads, isa = torch.get_num_threads(), prepared.kernels.isa_code
        if prepared.w8 is not None:
            lib.sq_w8_linear(prepared.w8.weight_ref, xf.data_ptr(), batch, y.data_ptr(), bias_ptr, isa, threads)
        else:
            lib.sq_lut_matmul(
                prepared.weight_ref, xf.data_ptr(), batch, y.data_ptr(), bias_ptr, isa, threads, int(prepared.bf16)
            )
    return y if x.dtype == torch.float32 else y.to(x.dtype)


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
    "covers",
    "prepare_cpu",
    "cpu_lut_linear",
    "permuted_positions",
]
