"""Sorted rows with prefix sums: the data structure of the 1-D k-means (squeeze.quant.kmeans).

"Sorted" means each row ascending; a position p in [0, N] cuts a sorted row into the points [0, p) and
[p, N). Any run of sorted points has its weight, weighted sum and weighted sum of squares as differences of
prefix sums, so a clustering's cost and means cost O(1) per cell.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Row positions are packed into the low mantissa bits of float64 copies of float32 values (see sort_rows).
INDEX_BITS = 29


def sort_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row of float32 x (R, N): (values as float64 (R, N), positions int64 (R, N)).

    On CPU, torch's row sort is slow; numpy's SIMD sort of float64 is several times faster but cannot
    return the permutation. A float32 widened to float64 has 29 zero low mantissa bits, so we store each
    element's position there: that moves the value by less than one float32 ulp, so the order of distinct
    values is unchanged, and both the exact value and the position are recovered from the sorted keys.
    (Infinities become NaNs while sorted and NaNs sort last, so a non-finite value always ends up at a row
    end, where the caller looks for it.)
    """
    R, N = x.shape
    if x.device.type != "cpu" or N >= 1 << INDEX_BITS:
        values, order = x.sort(1)
        return values.to(torch.float64), order
    keys = x.to(torch.float64).view(torch.int64).bitwise_or_(torch.arange(N, dtype=torch.int64))  # (R, N)
    keys.view(torch.float64).numpy().sort(axis=1)  # in place, through the shared buffer
    mask = (1 << INDEX_BITS) - 1
    order = keys & mask
    return keys.bitwise_and_(~mask).view(torch.float64), order


class SortedRows:
    """One chunk of sorted rows, float64: values xs (R, N) and inclusive prefix sums pw, pwx, pwxx (R, N).

    pw[:, p-1] is the weight of the first p sorted points, pwx of weight * (x - center), pwxx of
    weight * (x - center)**2, so any run of points has its weight, sum and sum of squares as two gathers and
    a subtraction (``prefix_at`` supplies the empty prefix, p = 0). Centring each row (center = its midrange)
    keeps ``Q - S**2 / W`` well conditioned; xs itself stays exact (the float32 values), so cell boundaries
    and codes are decided exactly.
    """

    def __init__(self, xs: Tensor, ws: Tensor) -> None:
        self.xs = xs
        self.ws = ws
        self._count: Tensor | None = None
        self.all_positive = bool(ws.numel() == 0 or ws.min() > 0)
        self.center = (xs[:, :1] + xs[:, -1:]) * 0.5  # (R, 1), exact
        d = xs - self.center
        wx = ws * d  # float64
        self.pw = ws.cumsum(1, dtype=torch.float64)
        self.pwx = wx.cumsum(1)
        self.pwxx = wx.mul_(d).cumsum(1)

    @property
    def count(self) -> Tensor | None:
        """int32 (R, N): how many of the first p+1 sorted points have positive weight (computed once), or
        None when every weight is positive (then it is p+1 and positions follow from ranks directly)."""
        if self._count is None and not self.all_positive:
            self._count = (self.ws > 0).cumsum(1, dtype=torch.int32)
        return self._count

    def position_of_rank(self, ranks: Tensor) -> Tensor:
        """Sorted position (R, m) of the weighted point of each rank (R, m), ranks in [1, #weighted]."""
        count = self.count
        if count is None:
            return (ranks - 1).to(torch.int64)
        return torch.searchsorted(count, ranks)  # first p with count[p] >= rank

    @property
    def n_weighted(self) -> Tensor:
        """int32 (R, 1): points with positive weight."""
        count = self.count
        if count is None:
            return torch.full((self.xs.shape[0], 1), self.xs.shape[1], dtype=torch.int32, device=self.xs.device)
        return count[:, -1:]

    @property
    def total(self) -> Tensor:
        """Weight of each row, (R, 1)."""
        return self.pw[:, -1:]

    def at(self, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Prefix sums (W, S, Q) at positions pos int64 (R, m) in [0, N], each (R, m)."""
        return prefix_at(self.pw, pos), prefix_at(self.pwx, pos), prefix_at(self.pwxx, pos)

    def means(self, W: Tensor, S: Tensor, fallback: Tensor) -> Tensor:
        """Weighted means (R, T, k) of cells with sums W, S (R, T, k); ``fallback`` where a cell weighs 0."""
        return torch.where(W > 0, self.center[:, :, None] + S / W.clamp_min(1e-300), fallback)

    def cells(self, c: Tensor) -> Tensor:
        """Cut positions (R, T, k-1) of the nearest-centroid cells of ascending centroids c (R, T, k)."""
        R, T, k = c.shape
        mids = (c[..., :-1] + c[..., 1:]) * 0.5  # (R, T, k-1)
        return torch.searchsorted(self.xs, mids.reshape(R, T * (k - 1))).view(R, T, k - 1)

    def cell_sums(self, cut: Tensor, squares: bool = False) -> tuple[Tensor, ...]:
        """Per-cell (W, S[, Q]) (R, T, k) of the cells delimited by cut positions (R, T, k-1)."""
        R, T, m = cut.shape
        flat = cut.reshape(R, T * m)
        out = []
        for prefix in (self.pw, self.pwx, self.pwxx) if squares else (self.pw, self.pwx):
            inner = prefix_at(prefix, flat).view(R, T, m)
            total = prefix[:, -1:, None].expand(R, T, 1)
            out.append(torch.cat([torch.zeros_like(total), inner, total], 2).diff(dim=2))  # (R, T, k)
        return tuple(out)


def prefix_at(prefix: Tensor, pos: Tensor) -> Tensor:
    """Exclusive prefix sum at positions pos (R, m) in [0, N] from an inclusive one (R, N): 0 at p = 0."""
    value = prefix.gather(1, (pos - 1).clamp(min=0))
    return value.masked_fill(pos == 0, 0.0)


__all__ = ["INDEX_BITS", "sort_rows", "SortedRows", "prefix_at"]
