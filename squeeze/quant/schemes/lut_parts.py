"""The parts of a LUT weight that live outside its classes (squeeze.quant.schemes.lut): the 8-bit affine grid
its levels are stored on, its sparse part as three tensors by role (and a row slice of it), and the checks of
quantize_lut's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from squeeze.limits import LUT_DTYPES
from squeeze.quant.schemes.roles import ANY_FLOAT, COLUMN_INDEX, HALF, Role
from squeeze.quant.sparse import SparseCSR

#: The sparse part's stored tensors (a CSR of the weights kept exactly).
SPARSE_ROLES = (
    Role("weight_sparse_rowptr", torch.int32, ("rows+1",), part="sparse"),
    Role("weight_sparse_cols", COLUMN_INDEX, ("nnz",), part="sparse"),
    Role("weight_sparse_vals", ANY_FLOAT, ("nnz",), part="sparse"),
)


def sparse_tensors(sparse: SparseCSR | None) -> dict[str, Tensor]:
    if sparse is None:
        return {}
    return {"weight_sparse_rowptr": sparse.rowptr, "weight_sparse_cols": sparse.cols, "weight_sparse_vals": sparse.vals}


def sparse_from_roles(found: Mapping[str, Tensor], in_features: int) -> SparseCSR | None:
    if "weight_sparse_rowptr" not in found:
        return None
    rowptr = found["weight_sparse_rowptr"]
    return SparseCSR(
        rowptr=rowptr,
        cols=found["weight_sparse_cols"],
        vals=found["weight_sparse_vals"],
        shape=(int(rowptr.shape[0]) - 1, in_features),
    )


def sparse_rows(sparse: SparseCSR | None, start: int, stop: int) -> SparseCSR | None:
    """Rows [start, stop) of a CSR, re-based so the slice is a well-formed CSR of its own (rowptr[0] == 0)."""
    if sparse is None:
        return None
    lo, hi = int(sparse.rowptr[start]), int(sparse.rowptr[stop])
    return SparseCSR(
        rowptr=sparse.rowptr[start : stop + 1] - sparse.rowptr[start],
        cols=sparse.cols[lo:hi],
        vals=sparse.vals[lo:hi],
        shape=(stop - start, sparse.shape[1]),
    )


def check_quantize_inputs(weight: Tensor, fisher: Tensor | None, mask: Tensor | None, lut_dtype: str) -> None:
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        found = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating-point tensor, found {found}")
    if fisher is not None and (
        not isinstance(fisher, Tensor) or fisher.shape != weight.shape or not fisher.is_floating_point()
    ):
        found = f"{fisher.dtype} {tuple(fisher.shape)}" if isinstance(fisher, Tensor) else type(fisher).__name__
        raise ValueError(f"fisher must be a floating-point tensor of shape {tuple(weight.shape)}, found {found}")
    if mask is not None and (mask.shape != weight.shape or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(weight.shape)}, found {mask.dtype} {tuple(mask.shape)}"
        )
    if lut_dtype not in LUT_DTYPES:
        raise ValueError(f"lut_dtype must be one of {list(LUT_DTYPES)}, found {lut_dtype!r}")


def affine_lut8(centroids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Centroids float (R, K) ascending -> (levels uint8 (R, K), scale float16 (R, 1), zero float16 (R, 1)).

    The grid spans each row's [min, max] in 255 steps; scale and zero are rounded to float16 first and the
    levels computed against the rounded values, so value = level * scale + zero is what gets stored.
    """
    c = centroids.to(torch.float32)
    lo, hi = c.min(dim=1, keepdim=True).values, c.max(dim=1, keepdim=True).values  # (R, 1)
    zero = lo.to(HALF)
    span = (hi - zero.to(torch.float32)).clamp_min(0.0)
    scale = (span / 255.0).to(HALF)
    scale = torch.where(scale.to(torch.float32) > 0, scale, torch.ones_like(scale))  # constant rows
    levels = ((c - zero.to(torch.float32)) / scale.to(torch.float32)).round().clamp(0, 255).to(torch.uint8)
    return levels, scale, zero
