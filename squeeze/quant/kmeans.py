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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from squeeze.errors import ModelError

#: Largest k solved with the candidate-cut dynamic program (bits <= 4); larger k uses companded Lloyd.
DP_MAX_K = 16
#: Candidate cuts per centroid in each of the two DP candidate sets.
_CUTS_PER_CLUSTER = 5
#: Most candidate intervals one middle run may span in the DP (its cost is O(B * band * k) per row).
_BAND = 12
#: Weighted points per block when estimating the local density for companding (at least; long rows use
#: at most _DENSITY_BLOCKS blocks, plenty for the 5k cuts drawn from it).
_DENSITY_BLOCK = 8
_DENSITY_BLOCKS = 256
#: Panter-Dite: the MSE-optimal high-resolution quantizer has centroid density proportional to p(x)**(1/3).
_COMPAND_EXPONENT = 1.0 / 3.0
#: Element budget per chunk of rows (each float64 working array holds about this many elements).
_CHUNK_ELEMENTS = 1 << 18
#: Default Lloyd iterations after the DP (6 matches 50 on the quality benchmark) and from a companded start.
_LLOYD_AFTER_DP = 6
_LLOYD_FROM_COMPANDED = 30
#: Row positions are packed into the low mantissa bits of float64 copies of float32 values (see _sort_rows).
_INDEX_BITS = 29


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
    chunk = max(1, _CHUNK_ELEMENTS // max(N, 2 * (_CUTS_PER_CLUSTER * k + 1) * (_BAND + 1)))
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
# Internals. "Sorted" means each row ascending; a position p in [0, N] cuts a sorted row into the points
# [0, p) and [p, N). Work is done per chunk of rows.


def _validate(x: Tensor, w: Tensor, k: int, max_iter: int, centroid_dtype: torch.dtype) -> None:
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise TypeError("weighted_kmeans_1d expects torch tensors for x and w")
    if x.dim() != 2 or w.shape != x.shape:
        raise ValueError(
            f"x and w must both be 2-D of the same shape, found {tuple(x.shape)} and {tuple(w.shape)}"
        )
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


def _sort_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row of float32 x (R, N): (values as float64 (R, N), positions int64 (R, N)).

    On CPU, torch's row sort is slow; numpy's SIMD sort of float64 is several times faster but cannot
    return the permutation. A float32 widened to float64 has 29 zero low mantissa bits, so we store each
    element's position there: that moves the value by less than one float32 ulp, so the order of distinct
    values is unchanged, and both the exact value and the position are recovered from the sorted keys.
    (Infinities become NaNs while sorted and NaNs sort last, so a non-finite value always ends up at a row
    end, where the caller looks for it.)
    """
    R, N = x.shape
    if x.device.type != "cpu" or N >= 1 << _INDEX_BITS:
        values, order = x.sort(1)
        return values.to(torch.float64), order
    keys = x.to(torch.float64).view(torch.int64).bitwise_or_(torch.arange(N, dtype=torch.int64))  # (R, N)
    keys.view(torch.float64).numpy().sort(axis=1)  # in place, through the shared buffer
    mask = (1 << _INDEX_BITS) - 1
    order = keys & mask
    return keys.bitwise_and_(~mask).view(torch.float64), order


class _Rows:
    """One chunk of sorted rows, float64: values xs (R, N) and inclusive prefix sums pw, pwx, pwxx (R, N).

    pw[:, p-1] is the weight of the first p sorted points, pwx of weight * (x - center), pwxx of
    weight * (x - center)**2, so any run of points has its weight, sum and sum of squares as two gathers and
    a subtraction (``_at`` supplies the empty prefix, p = 0). Centring each row (center = its midrange)
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
        return _at(self.pw, pos), _at(self.pwx, pos), _at(self.pwxx, pos)

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
            inner = _at(prefix, flat).view(R, T, m)
            total = prefix[:, -1:, None].expand(R, T, 1)
            out.append(torch.cat([torch.zeros_like(total), inner, total], 2).diff(dim=2))  # (R, T, k)
        return tuple(out)


def _at(prefix: Tensor, pos: Tensor) -> Tensor:
    """Exclusive prefix sum at positions pos (R, m) in [0, N] from an inclusive one (R, N): 0 at p = 0."""
    value = prefix.gather(1, (pos - 1).clamp(min=0))
    return value.masked_fill(pos == 0, 0.0)


def _fit_chunk(
    x: Tensor, w: Tensor, k: int, max_iter: int, centroid_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(centroids float32 (R, k) ascending, codes (R, N)) for one chunk x, w float32 (R, N), N >= 1.

    Codes come back as uint8 when k <= 256 (the caller widens them while copying out).
    """
    R, N = x.shape
    xs, order = _sort_rows(x)  # (R, N) float64 (exact float32 values), int64
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
    rows = _Rows(xs, ws)
    bad = ~(torch.isfinite(rows.total) & (rows.total > 0))  # NaN or inf if any weight is (weights >= 0)
    if bool(bad.any()):  # no usable sensitivity in this row: plain (uniform) k-means for it
        rows = _Rows(xs, torch.where(bad, torch.ones_like(ws), ws))

    if N <= k:
        # Every point can have its own centroid: zero error. Pad by repeating the largest value.
        c = torch.cat([xs, xs[:, -1:].expand(R, k - N)], 1)
    elif k == 1:
        c = rows.center + rows.pwx[:, -1:] / rows.pw[:, -1:]  # the weighted mean
    elif k <= DP_MAX_K:
        c = _dp_then_lloyd(rows, k, max_iter)
    else:
        c = _lloyd(rows, _compand_quantiles(rows, k)[:, None, :], max_iter)[:, 0]
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


def _dp_then_lloyd(rows: _Rows, k: int, max_iter: int) -> Tensor:
    """Ascending centroids (R, k): DP on each candidate cut set, keep the better solution, refine with Lloyd."""
    R, N = rows.xs.shape
    dev = rows.xs.device
    M = _CUTS_PER_CLUSTER * k
    if N <= M:
        # Every position is a candidate and no band applies: the DP is exact 1-D k-means.
        cuts = torch.arange(N + 1, device=dev).expand(R, 1, N + 1)
        band = N
    else:
        sets = [_cuts_companded(rows, M), _cuts_tails_and_quantiles(rows, M)]
        cuts = torch.stack([_dedupe_cuts(s, N) for s in sets], 1)  # (R, 2, M+1)
        band = _BAND
    T, B = cuts.shape[1], cuts.shape[2]
    W, S, Q = (v.view(R * T, B) for v in rows.at(cuts.reshape(R, T * B)))
    end_idx = _dp(W, S, Q, k, band)  # (R*T, k)
    ends = cuts.reshape(R * T, B).gather(1, end_idx).view(R, T, k)  # run ends as positions
    c = _run_means(rows, ends)  # (R, T, k)
    if T > 1:
        # Refine only each row's better DP solution: Lloyd rarely reverses the ranking, and this halves it.
        pick = _sse(rows, c).argmin(1)  # (R,)
        c = c[torch.arange(R, device=dev), pick][:, None]
    return _lloyd(rows, c, max_iter)[:, 0]


def _cuts_companded(rows: _Rows, M: int) -> Tensor:
    """M+1 cut positions (R, M+1) equally spaced in the companded coordinate (density**(1/3) measure)."""
    R, N = rows.xs.shape
    fractions = torch.arange(1, M, dtype=torch.float64, device=rows.xs.device) / M
    inner = torch.searchsorted(rows.xs, _companded_values(rows, fractions))  # (R, M-1)
    return torch.cat([inner.new_zeros(R, 1), inner, inner.new_full((R, 1), N)], 1)


def _cuts_tails_and_quantiles(rows: _Rows, M: int) -> Tensor:
    """M+1 cut positions (R, M+1): a cut after each of the M/4 smallest and before each of the M/4 largest
    weighted points (sparse heavy tails, where an isolated point may deserve its own centroid) and M/2 - 1
    weight quantiles (the bulk). Zero-weight points (e.g. those moved to the sparse part) are skipped, so
    they do not use up the tail cuts."""
    R, N = rows.xs.shape
    dev = rows.xs.device
    n_tail = M // 4
    n_q = M - 2 * n_tail
    ranks = torch.arange(1, n_tail + 1, device=dev, dtype=torch.int32)
    ranks = torch.cat([ranks.expand(R, n_tail), rows.n_weighted - ranks], 1)  # (R, 2*n_tail)
    # cut right after the weighted point of each rank
    tails = rows.position_of_rank(ranks.clamp(min=1)) + 1
    tails = torch.where(ranks > 0, tails, torch.zeros_like(tails)).clamp(max=N)
    fq = torch.arange(1, n_q, dtype=torch.float64, device=dev) / n_q  # (n_q - 1,)
    # first position p with (weight of the first p points) >= q; q > 0, so p >= 1
    q_cuts = (torch.searchsorted(rows.pw, fq * rows.total) + 1).clamp(max=N)  # (R, n_q - 1)
    ends = torch.tensor([0, N], device=dev)
    return torch.cat([ends.expand(R, 2), tails, q_cuts], 1)


def _dedupe_cuts(cuts: Tensor, n: int) -> Tensor:
    """Sort cuts (R, B) and move repeated positions to the end (as n): every interval before is non-empty.

    That matters for the band: an empty candidate interval would otherwise use up a run's span.
    """
    cuts = cuts.sort(1).values
    repeat = torch.zeros_like(cuts, dtype=torch.bool)
    repeat[:, 1:] = cuts[:, 1:] == cuts[:, :-1]
    return cuts.masked_fill(repeat, n).sort(1).values


def _companded_values(rows: _Rows, fractions: Tensor) -> Tensor:
    """Values (R, m) at the given fractions (m,) of each row's companded coordinate.

    The coordinate is the cumulative density**(1/3) measure (Panter-Dite), so equal steps in it place
    centroids (or cuts) where an MSE-optimal quantizer would. The density is estimated per block of
    weighted points (block weight over block value span): a block's measure is
    weight**(1/3) * span**(2/3), and the coordinate is linear in value inside a block. Blocks keep this
    O(N / block), float32 is plenty, and zero-weight points (wherever they lie) take no part.
    """
    xs = rows.xs
    R, N = xs.shape
    n_weighted = rows.n_weighted  # (R, 1), >= 1
    block = max(_DENSITY_BLOCK, -(-N // _DENSITY_BLOCKS))
    first_rank = torch.arange(1, N + 1, block, device=xs.device, dtype=torch.int32)  # (nb,)
    ranks = torch.cat([first_rank.expand(R, -1), n_weighted], 1).minimum(n_weighted)  # (R, nb+1)
    edge_pos = rows.position_of_rank(ranks)  # (R, nb+1): first point of each block, then the last
    x_edges = xs.gather(1, edge_pos)  # spans tile [smallest, largest] weighted value
    cut = torch.cat([edge_pos[:, :-1], edge_pos.new_full((R, 1), N)], 1)  # block j = points [cut_j, cut_j+1)
    mass = _at(rows.pw, cut).diff(dim=1).to(torch.float32).clamp_min_(0)  # (R, nb)
    span = x_edges.diff(dim=1).to(torch.float32)
    measure = (mass * span * span).pow_(_COMPAND_EXPONENT)  # (mass / span)^(1/3) * span
    coord = F.pad(measure.cumsum(1, dtype=torch.float64), (1, 0))  # (R, nb+1), coord[:, 0] = 0
    q = fractions * coord[:, -1:]  # (R, m)
    j = (torch.searchsorted(coord, q, right=True) - 1).clamp(0, coord.shape[1] - 2)  # block of each q
    c0, c1 = coord.gather(1, j), coord.gather(1, j + 1)
    t = ((q - c0) / (c1 - c0).clamp_min(1e-300)).clamp(0, 1)
    x0, x1 = x_edges.gather(1, j), x_edges.gather(1, j + 1)
    return x0 + t * (x1 - x0)


def _compand_quantiles(rows: _Rows, k: int) -> Tensor:
    """Initial centroids (R, k) at the (j + 1/2)/k quantiles of the companded coordinate."""
    fractions = (torch.arange(k, dtype=torch.float64, device=rows.xs.device) + 0.5) / k
    return torch.cummax(_companded_values(rows, fractions), 1).values


def _dp(W: Tensor, S: Tensor, Q: Tensor, k: int, band: int) -> Tensor:
    """Best split of each row into k runs whose boundaries are candidate cuts (dynamic programming).

    W, S, Q float64 (R, B): prefix sums at the candidate cuts, first = empty prefix, last = whole row.
    The first and last runs may span any number of candidate intervals, the k - 2 middle ones at most
    ``band`` (exact when B - 1 <= band); that bounds the cost to O(R * B * band * k) instead of
    O(R * B**2 * k). Returns int64 (R, k): the candidate index where each run ends (the last is B - 1).
    """
    R, B = W.shape
    L = max(1, min(band, B - 1))
    inf = float("inf")

    def run_cost(Wi: Tensor, Si: Tensor, Qi: Tensor, Wj: Tensor, Sj: Tensor, Qj: Tensor) -> Tensor:
        # weighted SSE of a run about its mean, Q - S^2 / W, in float64 (clamped: rounding can dip below 0),
        # then float32: only comparisons matter and it halves the memory traffic of the sweeps
        dS = Si - Sj
        return ((Qi - Qj) - dS * dS / (Wi - Wj).clamp_min(1e-300)).clamp_min(0).to(torch.float32)

    first = run_cost(W, S, Q, W[:, :1], S[:, :1], Q[:, :1])  # (R, B): cut 0 -> cut i
    last = run_cost(W[:, -1:], S[:, -1:], Q[:, -1:], W, S, Q)  # (R, B): cut j -> cut B-1
    layers = [first]  # layers[m-1][r, i]: best cost of covering cuts 0 -> i with m runs
    cost = first.new_empty(0)
    if k > 2:
        cost = _band_costs(W, S, Q, L)  # (L+1, R, B)
        best = torch.empty_like(first)
        tmp = torch.empty_like(first)
        for _ in range(k - 2):
            padded = F.pad(layers[-1], (L, 0), value=inf)  # (R, B+L): padded[:, i+e] = D[i-L+e]
            torch.add(padded[:, :B], cost[0], out=best)
            for e in range(1, L + 1):  # L+1 contiguous slabs: far faster than a min over a short axis
                torch.add(padded[:, e : e + B], cost[e], out=tmp)
                torch.minimum(best, tmp, out=best)
            layers.append(best.clone())
    # Backtrack. Only one argmin per row and run is needed, so it is recomputed from the stored layers
    # instead of tracking indices in every sweep; the float32 sums are identical, so it is optimal.
    end = (layers[-1] + last).argmin(1)  # (R,): where the second-to-last run ends
    ends = [torch.full_like(end, B - 1), end]
    offsets = torch.arange(L + 1, device=W.device)
    flat_cost = cost.view(L + 1, R * B) if k > 2 else cost
    row_base = torch.arange(R, device=W.device) * B
    for D in reversed(layers[:-1]):
        i = ends[-1]  # (R,)
        src = i[:, None] - L + offsets  # (R, L+1) candidate starts; < 0 is impossible
        prev = F.pad(D, (1, 0), value=inf).gather(1, (src + 1).clamp(min=0))
        e = (prev + flat_cost.index_select(1, row_base + i).T).argmin(1)
        ends.append(i - L + e)
    return torch.stack(ends[::-1], 1)


def _band_costs(W: Tensor, S: Tensor, Q: Tensor, L: int) -> Tensor:
    """cost[e, r, i] float32 (L+1, R, B): weighted SSE of the run from cut j = i - L + e to cut i.

    e = L is the empty run (cost 0), which is how rows with fewer distinct values than k leave centroids
    unused; j < 0 is impossible (inf). Band-major layout so each DP sweep step reads one contiguous (R, B)
    slab. Computed in float64 (Q - S^2 / W cancels), stored in float32.
    """
    R, B = W.shape
    diffs = []
    for prefix in (W, S, Q):
        window = F.pad(prefix, (L, 0)).unfold(1, L + 1, 1).permute(2, 0, 1)  # (L+1, R, B): prefix[i-L+e]
        d = torch.empty(L + 1, R, B, dtype=torch.float64, device=W.device)
        torch.sub(prefix[None], window, out=d)
        diffs.append(d)
    dW, dS, dQ = diffs
    dS.square_().div_(dW.clamp_min_(1e-300))
    cost = dQ.sub_(dS).clamp_min_(0).to(torch.float32)
    j = torch.arange(B, device=W.device)[None, :] - L + torch.arange(L + 1, device=W.device)[:, None]
    return cost.masked_fill_((j < 0)[:, None, :], float("inf"))


def _run_means(rows: _Rows, ends: Tensor) -> Tensor:
    """Weighted means (R, T, k) of the runs ending at positions ends (R, T, k); ascending, never NaN."""
    W, S = rows.cell_sums(ends[..., :-1])
    inf = torch.full_like(S, float("inf"))
    # fill an empty run from its left neighbour, leading empty runs from the first non-empty one (there is
    # one: every row has positive weight), so no centroid is ever placed by weightless points
    left = torch.cummax(rows.means(W, S, -inf), 2).values
    right = torch.cummin(rows.means(W, S, inf).flip(2), 2).values.flip(2)
    return torch.where(torch.isinf(left), right, left)


def _lloyd(rows: _Rows, c: Tensor, max_iter: int) -> Tensor:
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


def _sse(rows: _Rows, c: Tensor) -> Tensor:
    """Weighted SSE (R, T) of assigning every point to its nearest centroid c (R, T, k), from prefix sums."""
    W, S, Q = rows.cell_sums(rows.cells(c), squares=True)
    d = c - rows.center[:, :, None]  # sums are about the centre
    return (Q - 2 * d * S + d * d * W).sum(2)


__all__ = ["weighted_kmeans_1d", "nearest_codes", "DP_MAX_K"]
