"""LUT refit against the loss, LNQ-style, with the Fisher's sensitivity weighting kept (issue 51 item 1).

The k-means LUT (squeeze.quant.kmeans) minimises ``sum_c F_rc (w_rc - q_rc)^2`` per row ``r``: the diagonal
Fisher ``F`` (the end loss's sensitivity to each weight) and no correlation between input columns. The plain
layer objective ``(w - q) H (w - q)^T`` (squeeze.quant.ec) has the correlations but drops the sensitivity
weighting, and refitting the LUT to it lost on SmolLM2-135M (docs/benchmarks/quality.md). This module's
objective keeps both, one matrix per row:

    J_r(q) = e_r^T Hf_r e_r,   e_r = w_r - q_r,   Hf_r = S_r C S_r,   S_r = diag(sqrt(F_r))

``C`` is the input correlation ``H_ij / sqrt(H_ii H_jj)`` (``H = sum x x^T`` of the layer's inputs), shrunk
toward the identity by ``shrink`` for the fit (``(1 - shrink) C + shrink I``). Its diagonal is ``F_r``, so
without correlations (``shrink = 1``) ``J`` is exactly the k-means objective; the correlations then say how
the rounding errors of a row's columns add up in the output (for a Fisher that factors into an output-gradient
part and an input part, ``F_rc = g_r^2 H_cc``, ``J`` is ``g_r^2`` times the layer objective: GuidedQuant's
output weighting at one row per group).

LNQ (GuidedQuant, Kim et al. 2025): alternate (1) the closed-form refit of each row's levels for fixed codes,
with a ridge ``ridge * sum_k m_rk (l_k - l0_k)^2`` toward the k-means levels ``l0`` (``m_rk``: the Fisher mass
of level ``k``'s weights, so the ridge is in the objective's own units), and (2) code assignment by one sweep
of exact coordinate descent on ``J`` (each column's code set to the level that lowers ``J`` most with the
others fixed; never raises it). Each row keeps the iterate with the lowest objective on HELD-OUT tokens
(``C`` from a Hessian of inputs the fit did not see); the starting pair is a candidate, so no row, and no
layer, gets worse on the held-out objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

#: Columns per lazy update of the coordinate descent (as GPTQ's blocks: the gradient of the columns after a
#: block is updated once per block, by one matrix product).
BLOCK = 128


def correlation(hessian: Tensor, shrink: float = 0.0) -> Tensor:
    """float64 (N, N): ``(1 - shrink) * H_ij / sqrt(H_ii H_jj) + shrink * I`` of float (N, N) ``hessian``;
    dead inputs (``H_ii <= 0``) have no correlation and a unit diagonal. ValueError for a bad shape or
    ``shrink`` outside [0, 1]."""
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"hessian must be a square (N, N) matrix, found {tuple(hessian.shape)}")
    if not 0.0 <= shrink <= 1.0:
        raise ValueError(f"shrink must be in [0, 1], found {shrink}")
    h = hessian.detach().to(torch.float64)
    diag = torch.diagonal(h).clone()
    live = diag > 0
    inv = torch.where(live, diag.clamp_min(1e-300).rsqrt(), torch.zeros_like(diag))
    corr = h * inv[:, None] * inv[None, :]
    corr.fill_diagonal_(1.0)
    return (1.0 - shrink) * corr + shrink * torch.eye(len(diag), dtype=torch.float64)


def row_scales(fisher: Tensor | None, shape: torch.Size, mask: Tensor | None = None) -> Tensor:
    """float64 (R, N): ``sqrt(F)``, each row divided by its root mean (the objective's per-row scale does not
    move its minimum); a row with no Fisher mass (and ``fisher`` None) gets ones. ``mask`` (bool (R, N)):
    positions stored exactly, scale 0 (their error is 0 whatever the codes)."""
    if fisher is None:
        s2 = torch.ones(shape, dtype=torch.float64)
    else:
        s2 = fisher.detach().to(torch.float64).clamp_min(0.0)
        mean = s2.mean(dim=1, keepdim=True)
        s2 = torch.where(mean > 0, s2 / mean.clamp_min(1e-300), torch.ones_like(s2))
    if mask is not None:
        s2 = s2.masked_fill(mask, 0.0)
    return s2.sqrt()


def objective(weight: Tensor, values: Tensor, scale: Tensor, corr: Tensor) -> Tensor:
    """float64 (R,): ``J_r = (s_r * e_r) C (s_r * e_r)^T`` with ``e = weight - values`` (float (R, N) each),
    ``scale`` (R, N) from :func:`row_scales`, ``corr`` (N, N) from :func:`correlation`."""
    es = (weight.detach().to(torch.float64) - values.detach().to(torch.float64)) * scale
    return ((es @ corr) * es).sum(dim=1)


def refit_levels(weight: Tensor, codes: Tensor, scale: Tensor, corr: Tensor, anchor: Tensor, ridge: float) -> Tensor:
    """float64 (R, K): per row the levels minimising ``J_r + ridge * sum_k m_rk (l_k - anchor_rk)^2`` for the
    given codes, in closed form: ``(M^T C M + ridge diag(m)) l = M^T C (s * w) + ridge m * anchor`` with
    ``M = s * onehot(codes)`` (R, N, K) and ``m_rk = sum_{c: code k} s_rc^2``. A level no weight of positive
    scale uses keeps its anchor. weight float (R, N); codes int (R, N); anchor float (R, K); ridge >= 0."""
    k = anchor.shape[1]
    rows, cols = weight.shape
    onehot = torch.nn.functional.one_hot(codes.to(torch.int64), k).to(torch.float64)  # (R, N, K)
    m = onehot * scale[:, :, None]  # (R, N, K)
    cm = (corr @ m.permute(1, 0, 2).reshape(cols, rows * k)).reshape(cols, rows, k).permute(1, 0, 2)  # C M
    a = torch.einsum("rnk,rnj->rkj", m, cm)  # (R, K, K)
    b = torch.einsum("rnk,rn->rk", cm, scale * weight.detach().to(torch.float64))  # (R, K)
    mass = (m * m).sum(dim=1)  # (R, K)
    anchor64 = anchor.detach().to(torch.float64)
    a = a + ridge * torch.diag_embed(mass)
    b = b + ridge * mass * anchor64
    used = mass > 0
    eye = torch.eye(k, dtype=torch.float64).expand(rows, k, k)
    a = torch.where(used[:, :, None] & used[:, None, :], a, eye)
    b = torch.where(used, b, anchor64)
    a = a + 1e-12 * eye * a.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)[:, None, None]
    solution, info = torch.linalg.solve_ex(a, b)
    bad = (info != 0) | ~torch.isfinite(solution).all(dim=1)
    return torch.where(bad[:, None], anchor64, solution)


def descend_codes(weight: Tensor, levels: Tensor, codes: Tensor, scale: Tensor, corr: Tensor) -> Tensor:
    """int64 (R, N): one sweep of exact coordinate descent on ``J`` over the columns in order: each code set to
    the level (of float (R, K) ``levels``) that lowers ``J_r`` most with every other code fixed (the current
    code on a tie), so ``J`` never rises. Positions of scale 0 keep their codes (they do not change ``J``)."""
    w = weight.detach().to(torch.float64)
    lv = levels.detach().to(torch.float64)
    codes = codes.to(torch.int64).clone()
    es = (w - lv.gather(1, codes)) * scale  # (R, N)
    grad = es @ corr  # (R, N): (C es)_c per row
    cols = w.shape[1]
    diag = torch.diagonal(corr)
    for start in range(0, cols, BLOCK):
        stop = min(start + BLOCK, cols)
        delta_block = torch.zeros(w.shape[0], stop - start, dtype=torch.float64)
        for i, c in enumerate(range(start, stop)):
            s = scale[:, c : c + 1]  # (R, 1)
            candidate = (w[:, c : c + 1] - lv) * s  # (R, K): the scaled error of each level
            step = candidate - es[:, c : c + 1]
            gain = 2.0 * step * grad[:, c : c + 1] + step * step * diag[c]  # change of J per level
            current = codes[:, c : c + 1]
            gain = gain - gain.gather(1, current)  # 0 for the current code: it wins ties
            best = gain.argmin(dim=1, keepdim=True)
            best = torch.where(gain.gather(1, best) < 0, best, current)
            delta = step.gather(1, best).squeeze(1)  # (R,)
            codes[:, c] = best.squeeze(1)
            es[:, c] += delta
            delta_block[:, i] = delta
            grad[:, start:stop] += delta[:, None] * corr[c, start:stop][None, :]
        if stop < cols:
            grad[:, stop:] += delta_block @ corr[start:stop, stop:]
    return codes


class LnqRefit(NamedTuple):
    """:func:`lnq_refit`'s result. levels float32 (R, K): each row's levels as stored (not sorted); codes int64
    (R, N); round int64 (R,): 0 for a row that kept the starting pair, else the round its pair comes from;
    before / after float: the layer's held-out objective (sum of rows) of the starting pair and of the result
    (after <= before); fit_before / fit_after: the same on the fitted tokens."""

    levels: Tensor
    codes: Tensor
    round: Tensor
    before: float
    after: float
    fit_before: float
    fit_after: float


def lnq_refit(
    weight: Tensor,
    levels: Tensor,
    codes: Tensor,
    fisher: Tensor | None,
    hessian: Tensor,
    held_out: Tensor,
    store: Callable[[Tensor], Tensor],
    *,
    rounds: int,
    ridge: float,
    shrink: float,
    mask: Tensor | None = None,
) -> LnqRefit:
    """LNQ's alternation under the Fisher-weighted objective (module docstring), the best per row kept by the
    held-out objective.

    weight float (R, N); levels float (R, K): the stored k-means levels (also the ridge's anchor); codes int
    (R, N): the starting codes (k-means' nearest, or compensated); fisher float (R, N) or None; hessian
    float (N, N): ``sum x x^T`` of the fitted tokens; held_out (N, N): of other tokens, which only choose
    among the iterates; store: float32 (R, K) -> float32 (R, K), the levels as the format rounds them; mask
    bool (R, N): positions stored exactly (sparse). ValueError for rounds < 0, ridge < 0, shrink outside
    [0, 1] or inconsistent shapes.
    """
    if rounds < 0 or ridge < 0:
        raise ValueError(f"rounds and ridge must be >= 0, found {rounds} and {ridge}")
    rows, cols = weight.shape
    if codes.shape != weight.shape or levels.shape[0] != rows:
        raise ValueError(
            f"codes must be {tuple(weight.shape)} and levels (R={rows}, K), found {tuple(codes.shape)} and "
            f"{tuple(levels.shape)}"
        )
    if hessian.shape != (cols, cols) or held_out.shape != (cols, cols):
        raise ValueError(
            f"both Hessians must be ({cols}, {cols}), found {tuple(hessian.shape)}, {tuple(held_out.shape)}"
        )
    w64 = weight.detach().to(torch.float64)
    scale = row_scales(fisher, weight.shape, mask)
    fit_c, hold_c = correlation(hessian, shrink), correlation(held_out)
    anchor = levels.detach().to(torch.float32)
    cur_levels, cur_codes = anchor, codes.detach().to(torch.int64)
    values = cur_levels.to(torch.float64).gather(1, cur_codes)
    best_err = objective(w64, values, scale, hold_c)
    fit_before = float(objective(w64, values, scale, fit_c).sum())
    best_levels, best_codes = anchor.clone(), cur_codes.clone()
    best_round = torch.zeros(rows, dtype=torch.int64)
    before = float(best_err.sum())
    for round_ in range(1, rounds + 1):
        fitted = refit_levels(w64, cur_codes, scale, fit_c, anchor, ridge).to(torch.float32)
        stored = store(fitted)
        stored = torch.where(torch.isfinite(stored), stored, cur_levels)  # past the format's range: keep
        new_codes = descend_codes(w64, stored, cur_codes, scale, fit_c)
        for option in (cur_codes, new_codes):
            err = objective(w64, stored.to(torch.float64).gather(1, option), scale, hold_c)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_levels = torch.where(better[:, None], stored, best_levels)
            best_codes = torch.where(better[:, None], option, best_codes)
            best_round = torch.where(better, round_, best_round)
        cur_levels, cur_codes = stored, new_codes
    fit_after = float(objective(w64, best_levels.to(torch.float64).gather(1, best_codes), scale, fit_c).sum())
    return LnqRefit(best_levels, best_codes, best_round, before, float(best_err.sum()), fit_before, fit_after)


__all__ = ["correlation", "row_scales", "objective", "refit_levels", "descend_codes", "LnqRefit", "lnq_refit"]
