"""The W4A8 CPU kernel from Python (cpu_w8.cpp): a LUT weight's int8 form, and ``y = x @ W^T + b`` through it.

Each weight row's LUT is held as int8 levels with one float32 scale (made once, here, at load time); each call
quantizes the activations to int8 per group of 64 columns (one scale per row of x and group: an outlier channel
costs only its own group), decodes each weight panel once and multiplies it by all rows with int8 dot products
(AVX-512 VNNI, AVX2, scalar). The integer sums per group are exact and the groups are combined in one fixed
float32 order, so a row's result is the same at every batch size, on every instruction set and thread count:
one path for decode, serving and prefill, batch-invariant by construction. A call's groups start at its own
column 0, so a tensor-parallel shard's groups never cross the shard's boundary.
:func:`~squeeze.runtime.kernels.reference.w4a8_matmul_reference` is the same math in torch, and the tests hold
the kernel to it bit for bit.

Which activation precision the LUT kernels use is the load option ``activations``
(:mod:`squeeze.runtime.activations`): ``"float32"`` (the exact fp32-LUT kernels of cpu_lut.py, the default)
or ``"int8"`` (this kernel). Only 3- and 4-bit weights have an int8 form; other widths keep the float32 kernels.

Memory: 16 bytes of levels and 4 of scale per weight row, plus 8 per sparse entry (column, residual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.schemes.lut import LutWeight
from squeeze.runtime.activations import ACTIVATIONS, DEFAULT_ACTIVATIONS, Activations, check_activations
from squeeze.runtime.kernels.cpu_build import PreparedWeight, SqW8
from squeeze.runtime.kernels.reference import w8_lut, w8_sparse_residual

#: Code widths the int8 kernel covers.
W8_BITS = (3, 4)


@dataclass(frozen=True, eq=False)
class W8Prepared(PreparedWeight):
    """A 3/4-bit LUT weight in the int8 kernel's form. ``keep`` holds every tensor ``weight`` points into."""

    weight: SqW8
    keep: tuple[Tensor, ...]
    #: bytes beyond the module's own buffers: levels, scales, sparse columns and residuals
    extra_bytes: int


def prepare_w8(qweight: LutWeight, packed: Tensor) -> W8Prepared | None:
    """The int8 form of ``qweight`` (None for widths other than 3 and 4 bits); ``packed``: its contiguous codes."""
    if qweight.bits not in W8_BITS:
        return None
    levels, scale = w8_lut(qweight)  # (R, 16) int8, (R,) float32
    keep = [levels, scale]
    sparse_ptrs: list[int | None] = [None, None, None]
    if qweight.sparse is not None and qweight.sparse.nnz:
        rowptr, cols, resid = w8_sparse_residual(qweight, levels, scale)
        rowptr, cols = rowptr.contiguous(), cols.contiguous()
        keep += [rowptr, cols, resid]
        sparse_ptrs = [t.data_ptr() for t in (rowptr, cols, resid)]
    weight = SqW8(
        packed.data_ptr(),
        levels.data_ptr(),
        scale.data_ptr(),
        *sparse_ptrs,
        qweight.out_features,
        qweight.in_features,
        int(packed.shape[1]) if qweight.out_features else 0,
        qweight.bits,
    )
    own = {t.untyped_storage().data_ptr() for t in qweight.tensors_by_role().values()}
    extra = sum(t.numel() * t.element_size() for t in keep if t.untyped_storage().data_ptr() not in own)
    return W8Prepared(weight=weight, keep=(packed, *keep), extra_bytes=extra)


def bias_f32(bias: Tensor | None) -> Tensor | None:
    """``bias`` (R,) as the kernels read it: float32 and contiguous (itself when it is already)."""
    if bias is None:
        return None
    return bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.to(torch.float32).contiguous()


__all__ = [
    "bias_f32",
    "Activations",
    "ACTIVATIONS",
    "DEFAULT_ACTIVATIONS",
    "W8_BITS",
    "W8Prepared",
    "check_activations",
    "prepare_w8",
]
