"""Dense-and-sparse split: which weights leave the LUT-quantized matrix, and the CSR that holds them.

SqueezeLLM keeps a small fraction of weights exactly: the most *sensitive* ones (largest Fisher) and the
largest-magnitude *outliers*. ``select_sparse`` picks exactly the requested counts (no threshold tuning);
``SparseCSR`` stores them per row.

Replace semantics (a deliberate deviation from DESIGN.md's "residual" wording): ``vals`` are the ORIGINAL
weights and reconstruction REPLACES the dense value at those positions, so it is bit-exact there. A residual
``w - LUT[code]`` cannot reconstruct exactly in floating point in general (w = 1e-4 against a centroid of
0.01 loses the low bits of w); kernels that want an additive residual derive it at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.errors import FormatError, ModelError

#: Largest column count whose indices are stored as int16.
INT16_MAX_COLS = 32767


def select_sparse(weight: Tensor, fisher: Tensor | None, sensitive_fraction: float, outlier_fraction: float) -> Tensor:
    """Boolean mask (R, N) of the weights that go to the sparse part.

    Exactly ``round(sensitive_fraction * numel)`` positions with the largest Fisher, plus exactly
    ``round(outlier_fraction * numel)`` further positions (not already chosen) with the largest ``|w|``;
    the mask has exactly the sum of both counts. ``round`` is Python's (halves to even). Ties go to the
    lower flattened (row-major) index, so the result is deterministic.

    ``fisher=None`` (no sensitivity, e.g. uniform k-means) makes the sensitive part empty: only outliers are
    chosen, whatever ``sensitive_fraction`` says.
    """
    # Contract checks (ValueError). [0, 1] is the mathematical domain of a fraction of the matrix; what squeeze
    # offers users (at most squeeze.limits.MAX_SPARSE_FRACTION) is checked where recipes are read.
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating-point tensor, found {_describe(weight)}")
    if fisher is not None and (not isinstance(fisher, Tensor) or fisher.shape != weight.shape):
        raise ValueError(f"fisher must match the weight shape {tuple(weight.shape)}, found {_describe(fisher)}")
    for name, value in (("sensitive_fraction", sensitive_fraction), ("outlier_fraction", outlier_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], found {value}")
    numel = weight.numel()
    n_sensitive = 0 if fisher is None else int(round(sensitive_fraction * numel))
    n_outlier = int(round(outlier_fraction * numel))
    if n_sensitive + n_outlier > numel:
        raise ValueError(
            f"sensitive + outlier counts ({n_sensitive} + {n_outlier}) exceed the {numel} weights of the matrix"
        )
    if not bool(torch.isfinite(weight).all()):  # the model's own weights: not squeeze's bug, not a usage error
        raise ModelError("weight contains NaN or infinite values")

    mask = torch.zeros(numel, dtype=torch.bool, device=weight.device)
    if n_sensitive:
        scores = fisher.detach().reshape(-1).to(torch.float32)  # type: ignore[union-attr]
        if not bool(torch.isfinite(scores).all()):
            raise ModelError("fisher contains NaN or infinite values")
        mask |= _top_k_mask(scores, n_sensitive)
    if n_outlier:
        # |w| >= 0, so -1 ranks every already-chosen position below all candidates
        scores = weight.detach().reshape(-1).abs().to(torch.float32).masked_fill(mask, -1.0)
        mask |= _top_k_mask(scores, n_outlier)
    return mask.view(weight.shape)


def _top_k_mask(scores: Tensor, k: int) -> Tensor:
    """Mask (n,) of the k largest scores; among equal scores the lowest indices win (a stable sort's pick).

    O(n): the k-th largest value is a threshold; everything above it is in, and the first few positions
    equal to it fill the remaining slots.
    """
    n = scores.numel()
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    threshold = torch.kthvalue(scores, n - k + 1).values  # the k-th largest
    mask = scores > threshold
    missing = k - int(mask.sum())
    ties = torch.nonzero(scores == threshold).view(-1)[:missing]  # nonzero is in index order
    mask[ties] = True
    return mask


@dataclass(frozen=True)
class SparseCSR:
    """Per-row sparse weights (CSR).

    rowptr int32 (R+1,): row r's entries are [rowptr[r], rowptr[r+1]).
    cols int16 (nnz,) when the matrix has <= 32767 columns, else int32; ascending within each row.
    vals (nnz,): the original weights, in the weight's own dtype.
    shape: (R, N) of the dense matrix.
    """

    rowptr: Tensor
    cols: Tensor
    vals: Tensor
    shape: tuple[int, int]

    @staticmethod
    def col_dtype(n_cols: int) -> torch.dtype:
        """Column index dtype for a matrix with ``n_cols`` columns."""
        return torch.int16 if n_cols <= INT16_MAX_COLS else torch.int32

    @classmethod
    def from_mask(cls, mask: Tensor, values: Tensor) -> SparseCSR:
        """CSR of ``values`` (R, N) at the True positions of ``mask`` bool (R, N), vals in values' dtype."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise ValueError(f"mask must be a 2-D bool tensor, found {_describe(mask)}")
        if not isinstance(values, Tensor) or values.shape != mask.shape:
            raise ValueError(f"values must match the mask shape {tuple(mask.shape)}, found {_describe(values)}")
        R, N = mask.shape
        rows, cols = torch.nonzero(mask, as_tuple=True)  # row-major: rows grouped, cols ascending
        counts = torch.bincount(rows, minlength=R)
        rowptr = torch.zeros(R + 1, dtype=torch.int64, device=mask.device)
        rowptr[1:] = counts.cumsum(0)
        return cls(
            rowptr=rowptr.to(torch.int32),
            cols=cols.to(cls.col_dtype(N)),
            vals=values[rows, cols].clone(),
            shape=(R, N),
        )

    @property
    def nnz(self) -> int:
        """Number of stored entries."""
        return int(self.vals.numel())

    def storage_bits(self) -> int:
        """Exact stored size in bits: rowptr + cols + vals."""
        return sum(t.numel() * t.element_size() * 8 for t in (self.rowptr, self.cols, self.vals))

    def row_indices(self) -> Tensor:
        """int64 (nnz,): the row of every entry."""
        counts = (self.rowptr[1:] - self.rowptr[:-1]).to(torch.int64)
        return torch.repeat_interleave(torch.arange(self.shape[0], device=self.rowptr.device), counts)

    def scatter_into(self, dense: Tensor) -> Tensor:
        """Replace ``dense[r, c]`` by the stored values (cast to dense's dtype), in place; returns ``dense``."""
        if dense.shape != torch.Size(self.shape):
            raise ValueError(f"dense must have shape {self.shape}, found {tuple(dense.shape)}")
        dense[self.row_indices(), self.cols.to(torch.int64)] = self.vals.to(dense.dtype)
        return dense

    def col_slice(self, start: int, stop: int) -> SparseCSR:
        """The entries of columns [start, stop) as a CSR of shape (R, stop - start): columns re-based by -start
        and stored in the dtype for stop - start columns, rowptr int32 recomputed, vals kept in their dtype.

        A range that holds no entry gives an empty CSR (nnz = 0), not None: every slice keeps the same parts.
        """
        if not (0 <= start <= stop <= self.shape[1]):
            raise ValueError(f"column slice [{start}, {stop}) must satisfy 0 <= start <= stop <= {self.shape[1]}")
        cols = self.cols.to(torch.int64)
        keep = (cols >= start) & (cols < stop)
        counts = torch.bincount(self.row_indices()[keep], minlength=self.shape[0])
        rowptr = torch.zeros(self.shape[0] + 1, dtype=torch.int64, device=self.rowptr.device)
        rowptr[1:] = counts.cumsum(0)
        return SparseCSR(
            rowptr=rowptr.to(torch.int32),
            cols=(cols[keep] - start).to(self.col_dtype(stop - start)),
            vals=self.vals[keep],
            shape=(self.shape[0], stop - start),
        )

    def to_dense_mask_and_values(self) -> tuple[Tensor, Tensor]:
        """(mask bool (R, N), values (R, N) in vals' dtype, zero off the mask)."""
        rows, cols = self.row_indices(), self.cols.to(torch.int64)
        mask = torch.zeros(self.shape, dtype=torch.bool, device=self.vals.device)
        mask[rows, cols] = True
        values = torch.zeros(self.shape, dtype=self.vals.dtype, device=self.vals.device)
        values[rows, cols] = self.vals
        return mask, values

    def validate(self, rows: int, cols: int) -> None:
        """Check that this CSR is well-formed for a (rows, cols) matrix; FormatError otherwise.

        Checks dtypes and lengths, rowptr[0] == 0, rowptr non-decreasing and ending at nnz, column indices in
        range and strictly ascending within each row (no duplicates), and that ``shape`` matches.
        """
        if tuple(self.shape) != (rows, cols):
            raise FormatError(f"sparse part has shape {tuple(self.shape)}, expected {(rows, cols)}")
        rowptr, col, vals = self.rowptr, self.cols, self.vals
        if rowptr.dtype != torch.int32 or rowptr.dim() != 1 or rowptr.numel() != rows + 1:
            raise FormatError(f"sparse rowptr must be int32 of length {rows + 1} (rows + 1), found {_describe(rowptr)}")
        want = self.col_dtype(cols)
        if col.dtype != want or col.dim() != 1:
            raise FormatError(f"sparse cols must be a 1-D {want} tensor for {cols} columns, found {_describe(col)}")
        if not vals.is_floating_point() or vals.dim() != 1:
            raise FormatError(f"sparse vals must be a 1-D floating-point tensor, found {_describe(vals)}")
        nnz = vals.numel()
        if col.numel() != nnz:
            raise FormatError(f"sparse cols and vals must have the same length, found {col.numel()} and {nnz}")
        rp = rowptr.to(torch.int64)
        if int(rp[0]) != 0:
            raise FormatError(f"sparse rowptr must start at 0, found {int(rp[0])}")
        if rows and bool((rp[1:] < rp[:-1]).any()):
            raise FormatError("sparse rowptr must be non-decreasing")
        if int(rp[-1]) != nnz:
            raise FormatError(f"sparse rowptr must end at nnz = {nnz}, found {int(rp[-1])}")
        if nnz:
            c = col.to(torch.int64)
            if bool((c < 0).any()) or bool((c >= cols).any()):
                raise FormatError(
                    f"sparse cols must be in [0, {cols}), found values in [{int(c.min())}, {int(c.max())}]"
                )
            # within a row, each next column must be larger; a row boundary resets the order
            starts_row = torch.zeros(nnz, dtype=torch.bool, device=c.device)
            starts_row[rp[:-1][rp[:-1] < nnz]] = True
            if bool(((c[1:] <= c[:-1]) & ~starts_row[1:]).any()):
                raise FormatError("sparse cols must be strictly ascending within each row (no duplicates)")


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


__all__ = ["select_sparse", "SparseCSR", "INT16_MAX_COLS"]
