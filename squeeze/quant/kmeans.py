"""Weighted 1-D k-means, vectorised across rows (one independent problem per output row).

SqueezeLLM fits, for every output row of a weight matrix, ``k = 2**bits`` centroids minimising the
sensitivity-weighted squared error ``sum_j w_j * (x_j - c[code_j])**2``. sklearn solves one row at a time
(k-means++ then Lloyd), far too slow for a whole model. In 1-D the problem has structure we exploit for all
rows at once:

* Once a row is sorted, every cluster of an optimal (or Lloyd-stable) solution is a contiguous run of
  points, so a clustering is ``k - 1`` cut positions, and a run's weight, weighted sum and weighted sum of
  squares are differences of prefix sums: its cost ``Q - S**2 / W`` is O(1).
* Lloyd from a quantile start gets the global structure wrong on heavy-tailed rows (how many centroids go
  to the tails vs. the bulk). We get it right with a dynamic program that is exact over a *candidate cut
  set* of M = 5k positions per row (cost O(k * M * band) per row, independent of the row length). It runs
  on two candidate sets (density**(1/3)-companded cuts; tail points + weight quantiles) and each row keeps
  the better solution.
* Lloyd iterations refine a solution on the full data: cell boundaries are centroid midpoints found with
  ``searchsorted`` and cell sums are prefix-sum differences, O(k log N) per row and iteration.
* Codes are assigned in the sorted domain (a cumulative count of cells, scattered back), exact and O(N).

When a row has at most M points every position is a candidate and the DP is exact 1-D k-means. For large
k (8-bit LUTs, k = 256) the DP would cost too much and matters little; there Lloyd starts from the
companded quantiles. The algorithm is deterministic (no random initialisation).

The sorted rows and their prefix sums are squeeze.quant.kmeans_rows; the candidate cut sets, the DP and
the companded start are squeeze.quant.kmeans_init.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.errors import ModelError
from squeeze.quant.kmeans_init import BAND, CUTS_PER_CLUSTER, compand_quantiles, dp_solutions
from squeeze.quant.kmeans_rows import SortedRows, sort_rows

#: Largest k solved with the candidate-cut dynamic program (bits <= 4); larger k uses companded Lloyd.
DP_MAX_K = 16
#: Element budget per chunk of rows (each float64 working array holds about this many elements).
_CHUNK_ELEMENTS = 1 << 18
#: Default Lloyd iterations after the DP (6 matches 50 on the quality benchmark) and from a companded start.
_LLOYD_AFTER_DP = 6
_LLOYD_FROM_COMPANDED = 30


def weighted_kmeans_1d(
    x: Tensor,
    w: Tensor,
    k: int,
    *,
    max_iter: int | None = None,
    seed: int = 0,
    centroid_dtype: torch.dtype = torch.float32,
    codes_dtype: torch.dtype = torch.int64,
) -> tuple[Tensor, Tensor]:
    """Fit ``k`` centroids per row of ``x`` minimising the ``w``-weighted squared error.

    Args:
        x: float (R, N) values, finite; clustered as float32.
        w: float (R, N) nonnegative weights. Zero-weight points never move a centroid. A row whose weights
            sum to zero or contain a non-finite value is fitted with uniform weights instead.
        k: number of centroids per row (>= 1).
        max_iter: most Lloyd refinement iterations; it stops earlier at a fixed point. Default (None):
            6 after the DP initialisation (k <= 16; more do not change the result measurably), 30 for
            the companded start used for larger k.
        seed: accepted for API stability; the algorithm has no random initialisation, so results are
            identical for every seed.
        centroid_dtype: the dtype the centroids will be stored in (e.g. float16 for a LUT). Centroids are
            rounded to it before codes are assigned, so the codes are nearest for the stored values.
        codes_dtype: int64 (default) or uint8 (k <= 256), which saves 8x memory on big layers.

    Returns:
        ``(centroids, codes)``: centroids float32 (R, k), exactly representable in ``centroid_dtype``,
        ascending per row (unused centroids may repeat a value; never NaN); codes (R, N) in codes_dtype,
        the index of the nearest centroid of every point, zero-weight points included (ties: the lower
        index).
    """
    del seed  # deterministic algorithm; see docstring
    if max_iter is None:
        max_iter = _LLOYD_AFTER_DP if k <= DP_MAX_K else _LLOYD_FROM_COMPANDED
    _validate(x, w, k, max_iter, centroid_dtype)
    if codes_dtype not in (torch.int64, torch.uint8) or (codes_dtype == torch.uint8 and k > 256):
        raise ValueError(f"codes_dtype must be int64, or uint8 when k <= 256; found {codes_dtype} for k={k}")
    x = x.detach().to(torch.float32)
    w = w.detach().to(torch.float32)
    R, N = x.shape
    centroids = torch.zeros(R, k, dtype=torch.float32, device=x.device)
    codes = torch.empty(R, N, dtype=codes_dtype, device=x.device)
    if R == 0 or N == 0:
        return centroids, codes
    chunk = max(1, _CHUNK_ELEMENTS // max(N, 2 * (CUTS_PER_CLUSTER * k + 1) * (BAND + 1)))
    for start in range(0, R, chunk):
        rows = slice(start, min(R, start + chunk))
        centroids[rows], codes[rows] = _fit_chunk(x[rows], w[rows], k, max_iter, centroid_dtype)
    return centroids, codes


def nearest_codes(x: Tensor, centroids: Tensor) -> Tensor:
    """Index of the nearest centroid of every value: x float (R, N), centroids (R, k) ascending -> int64 (R, N).

    Midpoints are formed in float64, where the mean of two float32 (or float16) numbers is exact, so
    ``x <= midpoint`` is exactly ``|x - c_lo| <= |x - c_hi|``; ties go to the lower centroid.
    """
    c = centroids.to(torch.float64)
    mids = ((c[:, :-1] + c[:, 1:]) * 0.5).contiguous()  # (R, k-1)
    return torch.searchsorted(mids, x.to(torch.float64).contiguous())  # (R, N) in [0, k-1]


# ------------------------------------------------------------------------------------------------------
# Internals. Work is done per chunk of rows, sorted (squeeze.quant.kmeans_rows).


def _validate(x: Tensor, w: Tensor, k: int, max_iter: int, centroid_dtype: torch.dtype) -> None:
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise TypeError("weighted_kmeans_1d expects torch tensors for x and w")
    if x.dim() != 2 or w.shape != x.shape:
        raise ValueError(f"x and w must both be 2-D of the same shape, found {tuple(x.shape)} and {tuple(w.shape)}")
    if not x.is_floating_point() or not w.is_floating_point():
        raise ValueError(f"x and w must be floating point, found {x.dtype} and {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"x and w must be on the same device, found {x.device} and {w.device}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, found {k!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be an integer >= 0, found {max_iter!r}")
    if centroid_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"centroid_dtype must be float32, float16 or bfloat16, found {centroid_dtype}")
    # (x is checked for NaN / inf per chunk, after sorting, at no cost.) NaN weights are allowed (that row
    # falls back to uniform weights), and NaN < 0 is False, hence the second look when the min is NaN.
    if w.numel():
        low = w.min()
        if bool(low < 0) or (bool(torch.isnan(low)) and bool((w < 0).any())):
            raise ValueError("w must be nonnegative (a sensitivity), found negative entries")


def _fit_chunk(x: Tensor, w: Tensor, k: int, max_iter: int, centroid_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(centroids float32 (R, k) ascending, codes (R, N)) for one chunk x, w float32 (R, N), N >= 1.

    Codes come back as uint8 when k <= 256 (the caller widens them while copying out).
    """
    R, N = x.shape
    xs, order = sort_rows(x)  # (R, N) float64 (exact float32 values), int64
    # Sorting puts NaN and infinities at the ends, so checking the ends checks every value. x is a model's
    # weights (or cached keys / values): values squeeze cannot quantize are the model's (ModelError).
    ends = torch.cat([xs[:, :1], xs[:, -1:]], 1)
    if not bool(torch.isfinite(ends).all()):
        raise ModelError("x contains NaN or infinite values; cannot cluster them")
    limit = torch.finfo(centroid_dtype).max
    if centroid_dtype != torch.float32 and bool((ends.abs() > limit).any()):
        raise ModelError(
            f"x has values beyond the {centroid_dtype} range (|x| <= {limit:g}); the centroids cannot be stored"
        )
    ws = w.gather(1, order)  # float32; the prefix sums accumulate in float64
    rows = SortedRows(xs, ws)
    bad = ~(torch.isfinite(rows.total) & (rows.total > 0))  # NaN or inf if any weight is (weights >= 0)
    if bool(bad.any()):  # no usable sensitivity in this row: plain (uniform) k-means for it
        rows = SortedRows(xs, torch.where(bad, torch.ones_like(ws), ws))

    if N <= k:
        # Every point can have its own centroid: zero error. Pad by repeating the largest value.
        c = torch.cat([xs, xs[:, -1:].expand(R, k - N)], 1)
    elif k == 1:
        c = rows.center + rows.pwx[:, -1:] / rows.pw[:, -1:]  # the weighted mean
    elif k <= DP_MAX_K:
        c = _dp_then_lloyd(rows, k, max_iter)
    else:
        c = _lloyd(rows, compand_quantiles(rows, k)[:, None, :], max_iter)[:, 0]
    # Round to the storage dtype (monotone, so the order holds) and hand back as float32.
    c = torch.cummax(c, 1).values.to(torch.float32).to(centroid_dtype).to(torch.float32)

    # Codes in the sorted domain: the point at sorted position p gets the number of midpoints below it,
    # i.e. the number of cells cut at or before p; then scatter back to the original positions.
    c64 = c.to(torch.float64)
    mids = (c64[:, :-1] + c64[:, 1:]) * 0.5  # exact
    cut = torch.searchsorted(xs, mids.contiguous(), right=True)  # (R, k-1): #points <= midpoint
    code_dtype = torch.uint8 if k <= 256 else torch.int64
    marks = torch.zeros(R, N + 1, dtype=code_dtype, device=x.device)
    marks.scatter_add_(1, cut, torch.ones_like(cut, dtype=code_dtype))
    codes = torch.empty(R, N, dtype=code_dtype, device=x.device)
    codes.scatter_(1, order, marks[:, :N].cumsum(1, dtype=code_dtype))
    return c, codes


def _dp_then_lloyd(rows: SortedRows, k: int, max_iter: int) -> Tensor:
    """Ascending centroids (R, k): DP on each candidate cut set, keep the better solution, refine with Lloyd."""
    c = dp_solutions(rows, k)  # (R, T, k)
    R, T = c.shape[0], c.shape[1]
    if T > 1:
        # Refine only each row's better DP solution: Lloyd rarely reverses the ranking, and this halves it.
        pick = _sse(rows, c).argmin(1)  # (R,)
        c = c[torch.arange(R, device=rows.xs.device), pick][:, None]
    return _lloyd(rows, c, max_iter)[:, 0]


def _lloyd(rows: SortedRows, c: Tensor, max_iter: int) -> Tensor:
    """Lloyd iterations from ascending centroids c (R, T, k): T independent solutions per row.

    A cell is the run of sorted points between two centroid midpoints, so its weight and sum are prefix-sum
    differences: O(k log N) per row and iteration. Stops once no boundary moves (c is then a fixed point).
    An empty or zero-weight cell keeps its centroid; means stay inside their cells, so the order holds.
    """
    previous = None
    for _ in range(max_iter):
        cut = rows.cells(c)  # (R, T, k-1)
        if previous is not None and torch.equal(cut, previous):
            break
        previous = cut
        W, S = rows.cell_sums(cut)
        c = torch.cummax(rows.means(W, S, c), 2).values
    return c


def _sse(rows: SortedRows, c: Tensor) -> Tensor:
    """Weighted SSE (R, T) of assigning every point to its nearest centroid c (R, T, k), from prefix sums."""
    W, S, Q = rows.cell_sums(rows.cells(c), squares=True)
    d = c - rows.center[:, :, None]  # sums are about the centre
    return (Q - 2 * d * S + d * d * W).sum(2)


__all__ = ["weighted_kmeans_1d", "nearest_codes", "DP_MAX_K"]
