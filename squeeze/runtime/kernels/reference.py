"""Torch reference ops on a LutWeight: what every LUT kernel is tested against.

* :func:`lut_matmul_reference` - ``x @ W^T (+ bias)`` with ``W = qweight.dequantize()`` (exact, replace
  semantics for the sparse part), accumulated in float32.
* :func:`sparse_residual` - the format's sparse part turned ADDITIVE for kernels: the file stores the
  original weights at the sparse positions (``W[r, c] = vals[k]`` replaces the LUT value), a kernel wants
  ``W = LUT-dense + S`` so it can add ``x @ S^T`` to its dense result. ``S[r, c] = vals[k] - lut[r, code]``.
* :func:`csr_spmv_reference` - ``x @ S^T`` for a CSR matrix S, in float32.
* :func:`w4a8_matmul_reference` - the W4A8 product the native int8 kernel (cpu_w8.cpp) computes, bit for bit:
  int8 LUT levels with a per-row scale (:func:`w8_lut`), activations quantized to int8 per group of 64 columns,
  exact integer sums per group combined in one fixed float32 order, and the sparse residual against the
  unquantized activations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.quant.packing import codes_at
from squeeze.quant.schemes.lut import LutWeight


def lut_matmul_reference(x: Tensor, qweight: LutWeight, bias: Tensor | None = None) -> Tensor:
    """(..., R) in x.dtype: ``x (..., N) @ W^T + bias`` with W the exact dequantized weight.

    W is dequantized in float32 (fp16 LUT values and sparse values are exact there), the product is
    accumulated in float32 and rounded once to x.dtype at the end.
    """
    _check_x(x, qweight.in_features)
    weight = qweight.dequantize(torch.float32).to(x.device)  # (R, N)
    y = x.to(torch.float32) @ weight.T  # (..., R)
    if bias is not None:
        y = y + bias.to(device=x.device, dtype=torch.float32)
    return y.to(x.dtype)


def dense_lut_values(qweight: LutWeight) -> Tensor:
    """float32 (R, N): ``lut[r, code[r, c]]`` everywhere, i.e. the dequantized weight WITHOUT the sparse part."""
    return qweight.lut_values().gather(1, qweight.codes().to(torch.int64)).to(torch.float32)


def sparse_residual(qweight: LutWeight, codes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The sparse part as an additive CSR: (rowptr int32 (R+1,), cols int32 (nnz,), resid float32 (nnz,)).

    ``resid[k] = vals[k] - lut[r, code[r, cols[k]]]`` in float32, so ``dense_lut_values + S`` equals the
    replace-semantics dequantization up to one float32 rounding per sparse entry (the difference of a
    float16 LUT value and a float16/bfloat16 weight is exact in float32 unless their exponents are more
    than ~13 apart). Without a sparse part: rowptr of zeros and empty cols/resid. ``codes`` (uint8 (R, N),
    optional): the unpacked codes when the caller has them (the result is then on their device); without
    them only the codes at the sparse positions are read from the packed rows.
    """
    rows = qweight.out_features
    device = qweight.packed.device
    sparse = qweight.sparse
    if sparse is None:
        empty_i = torch.zeros(0, dtype=torch.int32, device=device)
        return torch.zeros(rows + 1, dtype=torch.int32, device=device), empty_i, torch.zeros(0, device=device)
    device = codes.device if codes is not None else device
    row_idx = sparse.row_indices().to(device)  # (nnz,) int64
    col_idx = sparse.cols.to(device=device, dtype=torch.int64)  # (nnz,)
    if codes is None:  # no (R, N) unpack: a load would hold every module's whole codes for a moment
        at = codes_at(qweight.packed, row_idx, col_idx, qweight.bits).to(torch.int64)  # (nnz,)
    else:
        at = codes[row_idx, col_idx].to(torch.int64)  # (nnz,)
    lut_at = qweight.lut_values().to(device)[row_idx, at]  # (nnz,)
    resid = sparse.vals.to(device=device, dtype=torch.float32) - lut_at
    return sparse.rowptr.to(device=device, dtype=torch.int32).clone(), col_idx.to(torch.int32), resid


def csr_spmv_reference(x: Tensor, rowptr: Tensor, cols: Tensor, vals: Tensor) -> Tensor:
    """float32 (..., R): ``x (..., N) @ S^T`` for S in CSR form (rowptr (R+1,), cols (nnz,), vals (nnz,))."""
    n_rows = int(rowptr.numel()) - 1
    if n_rows < 0:
        raise ValueError("rowptr must hold at least one element (R + 1 >= 1)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)  # (M, N)
    counts = (rowptr[1:] - rowptr[:-1]).to(torch.int64)  # (R,)
    row_idx = torch.repeat_interleave(torch.arange(n_rows, device=x.device), counts.to(x.device))  # (nnz,)
    contrib = x2[:, cols.to(device=x.device, dtype=torch.int64)] * vals.to(x.device, torch.float32)  # (M, nnz)
    y = torch.zeros(x2.shape[0], n_rows, dtype=torch.float32, device=x.device)
    y.index_add_(1, row_idx, contrib)
    return y.reshape(*lead, n_rows)


def w8_lut(qweight: LutWeight) -> tuple[Tensor, Tensor]:
    """(levels int8 (R, 16), scale float32 (R,)): each row's LUT as int8 levels times one scale.

    ``scale = amax / 127`` with amax the row's largest |LUT value|, ``levels = round(lut * (127 / amax))``
    (half to even, clamped to +-127; 0 and scale 0 for an all-zero row). 3-bit LUTs use 8 of the 16 levels
    (the rest 0). Made once per weight: the kernel's prepared form and this reference share it.
    """
    lut = qweight.lut_values(torch.float32)  # (R, 2**bits)
    amax = lut.abs().amax(dim=1) if lut.shape[1] else torch.zeros(lut.shape[0])  # (R,)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    levels = torch.zeros(lut.shape[0], 16, dtype=torch.int8)
    levels[:, : lut.shape[1]] = torch.round(lut * inv[:, None]).clamp(-127, 127).to(torch.int8)
    scale = torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax))
    return levels.contiguous(), scale.contiguous()


def w8_sparse_residual(qweight: LutWeight, levels: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The sparse part against the int8 LUT: (rowptr int32 (R+1,), cols int32 (nnz,), resid float32 (nnz,)) with
    ``resid = exact value - level * scale`` (float32), so a sparse position's weight is its exact value."""
    sparse = qweight.sparse
    if sparse is None or not sparse.nnz:
        empty = torch.zeros(0, dtype=torch.int32)
        return torch.zeros(qweight.out_features + 1, dtype=torch.int32), empty, torch.zeros(0)
    rowptr = sparse.rowptr.to(torch.int32).contiguous()  # the weight's own when int32 already: no copy
    cols = sparse.cols.to(torch.int32).contiguous()  # (nnz,)
    row_idx = sparse.row_indices().to(torch.int64)  # (nnz,)
    at = codes_at(qweight.packed, row_idx, cols.to(torch.int64), qweight.bits).to(torch.int64)  # (nnz,)
    approx = levels[row_idx, at].to(torch.float32) * scale[row_idx]
    return rowptr, cols, (sparse.vals.to(torch.float32) - approx).contiguous()


#: Columns per activation group of the W4A8 product (cpu_w8.cpp): each group of a row has its own int8 scale.
W8_GROUP = 64


def quantize_groups_int8(x: Tensor, group: int = W8_GROUP) -> tuple[Tensor, Tensor]:
    """(q float64 (M, N) of integers in [-127, 127], scale float32 (M, G)): float32 ``x (M, N)`` quantized per
    group of ``group`` columns (G = ceil(N / group); the last group may be shorter): ``round(x * (127 / amax))``
    (half to even) with ``scale = amax / 127`` and amax the group's largest |x| (0 and 0 for a zero group)."""
    m, n = x.shape
    groups = -(-n // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32)
    padded[:, :n] = x
    tiles = padded.view(m, groups, group)  # (M, G, group)
    amax = tiles.abs().amax(dim=2) if n else torch.zeros(m, 0)  # (M, G)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(tiles * inv[:, :, None]).clamp(-127, 127).view(m, groups * group)[:, :n]
    return q.to(torch.float64), torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax))


def w4a8_matmul_reference(x: Tensor, qweight: LutWeight, bias: Tensor | None = None) -> Tensor:
    """float32 (..., R): what the W4A8 kernel computes for ``x (..., N) @ W^T + bias``, bit for bit.

    Per group g of W8_GROUP columns, ``acc[b, r, g]`` is the exact integer dot product of the int8 activations
    and the row's int8 levels (float64 holds it exactly); ``t = 0; t = t + float32(acc[.., g]) * sx[b, g]`` for
    g in order; ``y = t * sw[r] + s + bias[r]``, with ``s`` the float32 sum, in CSR order from 0, of
    ``resid * x[b, col]`` over the row's sparse entries (:func:`w8_sparse_residual`).
    """
    _check_x(x, qweight.in_features)
    lead, n, rows = x.shape[:-1], qweight.in_features, qweight.out_features
    x2 = x.reshape(-1, n).to(torch.float32)  # (M, N)
    levels, sw = w8_lut(qweight)
    weights = levels.to(torch.float64).gather(1, qweight.codes().to(torch.int64))  # (R, N) integers
    q, sx = quantize_groups_int8(x2)  # (M, N), (M, G)
    y = torch.zeros(x2.shape[0], rows, dtype=torch.float32)
    for g in range(sx.shape[1]):
        cols = slice(g * W8_GROUP, min((g + 1) * W8_GROUP, n))
        acc = q[:, cols] @ weights[:, cols].T  # (M, R), exact: |sum| < 2^53
        y = y + acc.to(torch.float32) * sx[:, g : g + 1]
    y = y * sw[None, :]
    rowptr, cols_, resid = w8_sparse_residual(qweight, levels, sw)
    counts = (rowptr[1:] - rowptr[:-1]).to(torch.int64)  # (R,)
    s = torch.zeros_like(y)
    for k in range(int(counts.max()) if rows and resid.numel() else 0):  # the k-th entry of every row, in order
        has = counts > k
        at = (rowptr[:-1].to(torch.int64) + k).clamp(max=max(resid.numel() - 1, 0))  # (R,)
        term = resid[at] * x2[:, cols_[at].to(torch.int64)]  # (M, R)
        s = torch.where(has[None, :], s + term, s)
    y = y + s
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*lead, rows)


def _check_x(x: Tensor, in_features: int) -> None:
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != in_features:
        found = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (..., {in_features}), found {found}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, found {x.dtype}")


__all__ = [
    "lut_matmul_reference",
    "dense_lut_values",
    "sparse_residual",
    "csr_spmv_reference",
    "w8_lut",
    "w8_sparse_residual",
    "W8_GROUP",
    "quantize_groups_int8",
    "w4a8_matmul_reference",
]
