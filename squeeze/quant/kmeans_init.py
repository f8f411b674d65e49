"""Initial solutions of the 1-D k-means (squeeze.quant.kmeans): candidate cut sets and a banded DP over them.

A clustering of a sorted row is ``k - 1`` cut positions. The DP here is exact over a *candidate* cut set of
M = CUTS_PER_CLUSTER * k positions per row, in O(k * M * BAND) per row whatever the row length; it runs on
two sets (density**(1/3)-companded cuts; tail points + weight quantiles) so each row can keep the better
solution. The companded coordinate also gives the quantile start of large k (see :func:`compand_quantiles`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from squeeze.quant.kmeans_rows import SortedRows, prefix_at

#: Candidate cuts per centroid in each of the two DP candidate sets.
CUTS_PER_CLUSTER = 5
#: Most candidate intervals one middle run may span in the DP (its cost is O(B * band * k) per row).
BAND = 12
#: Weighted points per block when estimating the local density for companding (at least; long rows use
#: at most _DENSITY_BLOCKS blocks, plenty for the 5k cuts drawn from it).
_DENSITY_BLOCK = 8
_DENSITY_BLOCKS = 256
#: Panter-Dite: the MSE-optimal high-resolution quantizer has centroid density proportional to p(x)**(1/3).
_COMPAND_EXPONENT = 1.0 / 3.0


def dp_solutions(rows: SortedRows, k: int) -> Tensor:
    """Ascending centroids (R, T, k) of the DP on each candidate cut set (T = 2), or exact (T = 1) when a row
    has at most CUTS_PER_CLUSTER * k points."""
    R, N = rows.xs.shape
    dev = rows.xs.device
    M = CUTS_PER_CLUSTER * k
    if N <= M:
        # Every position is a candidate and no band applies: the DP is exact 1-D k-means.
        cuts = torch.arange(N + 1, device=dev).expand(R, 1, N + 1)
        band = N
    else:
        sets = [_cuts_companded(rows, M), _cuts_tails_and_quantiles(rows, M)]
        cuts = torch.stack([_dedupe_cuts(s, N) for s in sets], 1)  # (R, 2, M+1)
        band = BAND
    T, B = cuts.shape[1], cuts.shape[2]
    W, S, Q = (v.view(R * T, B) for v in rows.at(cuts.reshape(R, T * B)))
    end_idx = _dp(W, S, Q, k, band)  # (R*T, k)
    ends = cuts.reshape(R * T, B).gather(1, end_idx).view(R, T, k)  # run ends as positions
    return _run_means(rows, ends)  # (R, T, k)


def _cuts_companded(rows: SortedRows, M: int) -> Tensor:
    """M+1 cut positions (R, M+1) equally spaced in the companded coordinate (density**(1/3) measure)."""
    R, N = rows.xs.shape
    fractions = torch.arange(1, M, dtype=torch.float64, device=rows.xs.device) / M
    inner = torch.searchsorted(rows.xs, _companded_values(rows, fractions))  # (R, M-1)
    return torch.cat([inner.new_zeros(R, 1), inner, inner.new_full((R, 1), N)], 1)


def _cuts_tails_and_quantiles(rows: SortedRows, M: int) -> Tensor:
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


def _companded_values(rows: SortedRows, fractions: Tensor) -> Tensor:
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
    mass = prefix_at(rows.pw, cut).diff(dim=1).to(torch.float32).clamp_min_(0)  # (R, nb)
    span = x_edges.diff(dim=1).to(torch.float32)
    measure = (mass * span * span).pow_(_COMPAND_EXPONENT)  # (mass / span)^(1/3) * span
    coord = F.pad(measure.cumsum(1, dtype=torch.float64), (1, 0))  # (R, nb+1), coord[:, 0] = 0
    q = fractions * coord[:, -1:]  # (R, m)
    j = (torch.searchsorted(coord, q, right=True) - 1).clamp(0, coord.shape[1] - 2)  # block of each q
    c0, c1 = coord.gather(1, j), coord.gather(1, j + 1)
    t = ((q - c0) / (c1 - c0).clamp_min(1e-300)).clamp(0, 1)
    x0, x1 = x_edges.gather(1, j), x_edges.gather(1, j + 1)
    return x0 + t * (x1 - x0)


def compand_quantiles(rows: SortedRows, k: int) -> Tensor:
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
        shift = (prev + flat_cost.index_select(1, row_base + i).T).argmin(1)  # (R,) the e of the best start
        ends.append(i - L + shift)
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


def _run_means(rows: SortedRows, ends: Tensor) -> Tensor:
    """Weighted means (R, T, k) of the runs ending at positions ends (R, T, k); ascending, never NaN."""
    W, S = rows.cell_sums(ends[..., :-1])
    inf = torch.full_like(S, float("inf"))
    # fill an empty run from its left neighbour, leading empty runs from the first non-empty one (there is
    # one: every row has positive weight), so no centroid is ever placed by weightless points
    left = torch.cummax(rows.means(W, S, -inf), 2).values
    right = torch.cummin(rows.means(W, S, inf).flip(2), 2).values.flip(2)
    return torch.where(torch.isinf(left), right, left)


__all__ = ["CUTS_PER_CLUSTER", "BAND", "dp_solutions", "compand_quantiles"]
