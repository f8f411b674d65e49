"""Error-compensated LUT quantization (GPTQ's column-by-column update against a per-row LUT).

Plain SqueezeLLM gives every weight the code of its nearest LUT entry. With the input Hessian of the layer,
``H = sum x x^T`` (in, in), the output error ``||X W^T - X Q^T||^2 = tr((W - Q) H (W - Q)^T)`` can be cut
much further (LeanQuant, GuidedQuant): quantize the columns in order and push each column's rounding error
onto the columns not yet quantized, weighted by the inverse Hessian (GPTQ, Frantar et al. 2022):

    for column j:  q_j = nearest LUT entry of w_j (per row);  e_j = (w_j - q_j) / U_jj
                   w_k -= e_j * U_jk  for every k > j

with ``U`` the upper Cholesky factor of ``(H + lambda I)^-1``, ``lambda = damp * mean(diag H)``. Columns
are processed in blocks of ``block_size``; the update of the columns after a block is applied once per block
(GPTQ's lazy batch update). Dead inputs (``H_jj == 0``: the column never sees a nonzero input) get
``H_jj = 1`` and their weights are treated as 0, as GPTQ does: whatever is stored there does not change the
output.

Dense-and-sparse: positions in ``mask`` are stored exactly (their original value) in the sparse part, so
their error is 0 and later columns' compensation leaves them untouched.

The LUT (and so the packed format) is the one weighted k-means fitted, unchanged; only the codes differ. The
runtime reads the result as any other LUT weight.

Output-weighted Hessians (GuidedQuant, Kim et al. 2025): ``H = sum x x^T`` treats every output channel and
token alike, while the end loss does not. With ``hessian`` (G, N, N), group ``g`` of the rows (output
channels, split by :func:`row_groups`) is compensated against its own ``H_g = sum_t gbar_tg^2 x_t x_t^T``,
``gbar_tg^2`` the mean squared loss gradient of the group's outputs at token ``t``
(squeeze.calibrate.hessian.output_weighted_hessians): the second-order change of the loss a row's error
causes, to a block-diagonal Fisher approximation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

#: GPTQ's default dampening (fraction of the mean diagonal of H added to the diagonal).
DEFAULT_DAMP = 0.01
#: Columns per lazy-update block (GPTQ's default).
DEFAULT_BLOCK = 128


#: The last factor computed: (weak reference to its Hessian, the Hessian's version counter, damp, result). Linears
#: that share an input (q/k/v, gate/up) are quantized one after another with the same Hessian tensor.
_LAST: list[Any] = []


def cached_inverse_hessian_factor(
    hessian: Tensor, damp: float = DEFAULT_DAMP, act_order: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(U, dead, order): :func:`inverse_hessian_factor` of ``hessian`` (with ``act_order``: of ``hessian``
    permuted by ``order``, the columns by descending ``diag H``; else order is None), reused while the same
    unmodified tensor comes back with the same options."""
    if _LAST:
        ref, version, options, result = _LAST
        if ref() is hessian and version == hessian._version and options == (damp, act_order):
            return result  # type: ignore[no-any-return]
    order = None
    if act_order:
        order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
        upper, dead = inverse_hessian_factor(hessian[order][:, order], damp)
    else:
        upper, dead = inverse_hessian_factor(hessian, damp)
    result = (upper, dead, order)
    _LAST[:] = [weakref.ref(hessian), hessian._version, (damp, act_order), result]
    return result


def inverse_hessian_factor(hessian: Tensor, damp: float = DEFAULT_DAMP) -> tuple[Tensor, Tensor]:
    """(U, dead): ``U`` float32 (N, N) upper Cholesky factor of ``(H' + lambda I)^-1`` and ``dead`` bool (N,).

    ``H'`` is ``hessian`` (float (N, N), symmetric PSD) with every zero diagonal entry set to 1 (dead inputs);
    ``lambda = damp * mean(diag H')``. Computed in float64. If the Cholesky still fails (a numerically
    indefinite H), the dampening is raised tenfold up to 5 times; ValueError after that, or for a bad shape
    or a negative ``damp``.
    """
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"hessian must be a square (N, N) matrix, found {tuple(hessian.shape)}")
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, found {damp}")
    h = hessian.detach().to(torch.float64).clone()
    if not bool(torch.isfinite(h).all()):
        raise ValueError("hessian contains NaN or infinite values")
    diag = torch.diagonal(h)
    dead = diag <= 0
    diag[dead] = 1.0
    n = h.shape[0]
    mean_diag = float(diag.mean()) if n else 1.0
    idx = torch.arange(n)
    factor = damp
    for _ in range(6):
        damped = h.clone()
        damped[idx, idx] += factor * mean_diag
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper.to(torch.float32), dead
        factor = max(factor * 10, 1e-6)
    raise ValueError(f"the Hessian is not positive definite even with dampening {factor / 10:g} * mean(diag H)")


def row_groups(rows: int, groups: int) -> list[slice]:
    """The row ranges of ``groups`` output-channel groups of a (rows, N) weight: contiguous, as equal as
    possible (the first ``rows % groups`` one row longer), the split output-weighted Hessians use."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, found {groups}")
    base, extra = divmod(rows, groups)
    bounds = [0]
    for g in range(groups):
        bounds.append(bounds[-1] + base + (1 if g < extra else 0))
    return [slice(bounds[g], bounds[g + 1]) for g in range(groups)]


def compensated_codes(
    weight: Tensor,
    grid: Tensor,
    hessian: Tensor,
    *,
    mask: Tensor | None = None,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK,
    act_order: bool = False,
) -> Tensor:
    """Codes int64 (R, N): each row's LUT index per column, chosen column by column with error compensation.

    weight: float (R, N). grid: float (R, K), each row's LUT values as stored (the dequantized values).
    hessian: float (N, N), ``sum x x^T`` of the layer's inputs, or (G, N, N) output-weighted Hessians, one
    per group of rows (:func:`row_groups`; each group against its own). mask: bool (R, N), positions stored
    exactly (their codes are still nearest to their value, as plain quantization gives them; the sparse part
    replaces them). act_order: quantize the columns by descending ``diag H`` (GPTQ's act-order; the codes
    come back in the weight's own column order). ValueError for inconsistent shapes (see
    :func:`inverse_hessian_factor` for H's).
    """
    rows, cols = weight.shape
    if grid.dim() != 2 or grid.shape[0] != rows:
        raise ValueError(f"grid must be (R={rows}, K), found {tuple(grid.shape)}")
    if hessian.dim() == 3 and hessian.shape[1:] == (cols, cols):
        parts = [
            compensated_codes(
                weight[rows_g],
                grid[rows_g],
                hessian[g],
                mask=None if mask is None else mask[rows_g],
                damp=damp,
                block_size=block_size,
                act_order=act_order,
            )
            for g, rows_g in enumerate(row_groups(rows, hessian.shape[0]))
        ]
        return torch.cat(parts, dim=0)
    if hessian.shape != (cols, cols):
        raise ValueError(
            f"hessian must be ({cols}, {cols}) for a weight with {cols} columns, found {tuple(hessian.shape)}"
        )
    if mask is not None and (mask.shape != weight.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be bool {tuple(weight.shape)}, found {mask.dtype} {tuple(mask.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, found {block_size}")
    upper, dead, order = cached_inverse_hessian_factor(hessian, damp, act_order)
    if order is not None:
        weight = weight[:, order]
        mask = mask[:, order] if mask is not None else None
    w = weight.detach().to(torch.float32).clone()
    original = w.clone()
    w[:, dead] = 0.0  # a dead input: any stored value gives the same output; do not spread its rounding
    g = grid.detach().to(torch.float32)
    keep = None if mask is None or not bool(mask.any()) else mask
    codes = torch.empty(rows, cols, dtype=torch.int64)
    for start in range(0, cols, block_size):
        stop = min(start + block_size, cols)
        block = w[:, start:stop].clone()  # (R, B): updated in place as the block's columns are quantized
        errors = torch.zeros_like(block)
        u_block = upper[start:stop, start:stop]
        block_keep = None if keep is None else keep[:, start:stop]
        for i in range(stop - start):
            column = block[:, i]
            code = (column[:, None] - g).abs().argmin(dim=1)  # (R,): nearest entry (ties: the lower index)
            value = g.gather(1, code[:, None]).squeeze(1)
            err = (column - value) / u_block[i, i]
            if block_keep is not None:
                exact = block_keep[:, i]
                err = err.masked_fill(exact, 0.0)  # stored exactly: no error to spread
                code = torch.where(exact, _nearest(original[:, start + i], g), code)
            codes[:, start + i] = code
            errors[:, i] = err
            if i + 1 < stop - start:
                block[:, i + 1 :] -= err[:, None] * u_block[i, i + 1 :][None, :]
                if block_keep is not None:
                    block[:, i + 1 :] = torch.where(
                        block_keep[:, i + 1 :], original[:, start + i + 1 : stop], block[:, i + 1 :]
                    )
        if stop < cols:
            w[:, stop:] -= errors @ upper[start:stop, stop:]
            if keep is not None:
                w[:, stop:] = torch.where(keep[:, stop:], original[:, stop:], w[:, stop:])
    if order is not None:
        codes = torch.empty_like(codes).index_copy_(1, order, codes)  # back to the weight's column order
    return codes


def _nearest(values: Tensor, grid: Tensor) -> Tensor:
    return (values[:, None] - grid).abs().argmin(dim=1)


def refit_lut(
    weight: Tensor, codes: Tensor, hessian: Tensor, k: int, *, mask: Tensor | None = None, damp: float = DEFAULT_DAMP
) -> Tensor:
    """float32 (R, K): per row, the LUT values minimising ``(w - q) H (w - q)^T`` for the given codes.

    q = lut[codes] (sparse positions in ``mask`` hold their exact value and are not part of the fit). Solved
    per row as a K x K least-squares system ``(E H E^T) lut = E H r`` (E the one-hot code matrix, r the
    target with the sparse contribution removed), dampened like the compensation; an unused entry keeps 0
    contribution and is filled by the caller. A row whose system is singular or whose levels overflow float32
    comes back all NaN (never an exception): the caller keeps its previous levels. ``hessian`` (G, N, N): each
    group of rows (:func:`row_groups`) against its own.
    """
    rows, cols = weight.shape
    if hessian.dim() == 3:
        return torch.cat(
            [
                refit_lut(weight[r], codes[r], hessian[g], k, mask=None if mask is None else mask[r], damp=damp)
                for g, r in enumerate(row_groups(rows, hessian.shape[0]))
            ],
            dim=0,
        )
    h = hessian.detach().to(torch.float64).clone()
    diag = torch.diagonal(h)
    diag[diag <= 0] = 1.0
    diag += damp * float(diag.mean())
    w = weight.detach().to(torch.float64)
    onehot = torch.nn.functional.one_hot(codes.to(torch.int64), k).to(torch.float64)  # (R, N, K)
    if mask is not None:
        onehot = onehot.masked_fill(mask[:, :, None], 0.0)
        residual = w.masked_fill(~mask, 0.0)  # the sparse values' part of q: fixed
    else:
        residual = torch.zeros_like(w)
    eh = torch.einsum("rnk,nm->rkm", onehot, h)  # (R, K, N)
    a = torch.einsum("rkm,rmj->rkj", eh, onehot)  # (R, K, K)
    b = torch.einsum("rkm,rm->rk", eh, w - residual)  # (R, K)
    a = (
        a
        + 1e-12
        * torch.eye(k, dtype=torch.float64)
        * a.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)[:, None, None]
    )
    used = onehot.sum(dim=1) > 0  # (R, K)
    a = torch.where(used[:, :, None] & used[:, None, :], a, torch.eye(k, dtype=torch.float64).expand(rows, k, k))
    b = torch.where(used, b, torch.zeros_like(b))
    solution, info = torch.linalg.solve_ex(a, b)  # (R, K); info != 0: a singular row (never raises)
    solution = solution.to(torch.float32)
    bad = (info != 0) | ~torch.isfinite(solution).all(dim=1)  # (R,): a singular or overflowing row
    return solution.masked_fill(bad[:, None], float("nan"))  # NaN: the caller keeps that row's previous levels


def row_errors(weight: Tensor, values: Tensor, hessian: Tensor) -> Tensor:
    """float64 (R,): each row's output error ``(w - q) H (w - q)^T`` (the layer objective), float (R, N)
    ``weight`` and ``values`` (the dequantized row, sparse positions exact, so their error is 0); ``hessian``
    (N, N), or (G, N, N) with each group of rows (:func:`row_groups`) against its own."""
    rows = weight.shape[0]
    e = weight.detach().to(torch.float64) - values.detach().to(torch.float64)  # (R, N)
    if hessian.dim() == 3:
        return torch.cat(
            [
                (e[r] @ hessian[g].to(torch.float64) * e[r]).sum(dim=1)
                for g, r in enumerate(row_groups(rows, len(hessian)))
            ]
        )
    return (e @ hessian.detach().to(torch.float64) * e).sum(dim=1)


class Refit(NamedTuple):
    """:func:`refitted_codes`' result, per row the best pair met. levels float32 (R, K): the refitted levels
    before the format stores them (ascending; a row of round 0 has ``grid`` itself); stored float32 (R, K): as
    ``store`` gave them (what ``codes`` index); codes int64 (R, N); round int64 (R,): 0 for a row that kept
    the compensated codes against ``grid``, else the round its levels come from; error float64 (R,): its
    :func:`row_errors`."""

    levels: Tensor
    stored: Tensor
    codes: Tensor
    round: Tensor
    error: Tensor


def refitted_codes(
    weight: Tensor,
    grid: Tensor,
    hessian: Tensor,
    store: Callable[[Tensor], Tensor],
    *,
    rounds: int,
    mask: Tensor | None = None,
    damp: float = DEFAULT_DAMP,
    act_order: bool = False,
) -> Refit:
    """LNQ's alternation of code assignment and LUT refit, the best per row kept (:class:`Refit`).

    Round 0 is :func:`compensated_codes` against ``grid`` (float (R, K), the stored LUT values). Each later
    round refits every row's levels to the last codes by least squares under H (:func:`refit_lut`), sorts them
    ascending, rounds them as the format stores them (``store``: float32 (R, K) ascending -> float32 (R, K)
    stored values, row by row, deterministic) and re-chooses the codes with compensation against them. Every
    (levels, codes) pair met, the refitted levels with the codes they were fitted to as well, is scored per
    row by :func:`row_errors`; each row keeps its best, so the result is never worse under H than round 0
    alone. A refit that is singular or not finite once stored (levels beyond float16) keeps the row's
    previous levels for that round.
    """
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, found {rounds}")
    w32 = weight.detach().to(torch.float32)
    k = grid.shape[1]
    exact = None if mask is None or not bool(mask.any()) else mask
    raw = levels = grid.detach().to(torch.float32)
    codes = compensated_codes(w32, levels, hessian, mask=mask, damp=damp, act_order=act_order)
    error = row_errors(w32, _dequantized(levels, codes, w32, exact), hessian)
    best = Refit(raw, levels, codes, torch.zeros(w32.shape[0], dtype=torch.int64), error)
    for round_ in range(1, rounds + 1):
        fitted = refit_lut(w32, codes, hessian, k, mask=mask, damp=damp)
        used = torch.nn.functional.one_hot(codes, k).sum(dim=1) > 0  # (R, K): an unused entry keeps its level
        candidate = torch.where(used & torch.isfinite(fitted), fitted, raw)
        candidate, order = candidate.sort(dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand_as(order))  # old index -> new
        stored = store(candidate)
        finite = torch.isfinite(stored).all(dim=1)  # (R,): a row that is not keeps its previous levels
        raw = torch.where(finite[:, None], candidate, raw)
        stored = torch.where(finite[:, None], stored, levels)
        fitted_codes = torch.where(finite[:, None], rank.gather(1, codes), codes)
        new_codes = compensated_codes(w32, stored, hessian, mask=mask, damp=damp, act_order=act_order)
        for option in (fitted_codes, new_codes):
            error = row_errors(w32, _dequantized(stored, option, w32, exact), hessian)
            better = (error < best.error) & finite
            best = Refit(
                torch.where(better[:, None], raw, best.levels),
                torch.where(better[:, None], stored, best.stored),
                torch.where(better[:, None], option, best.codes),
                torch.where(better, round_, best.round),
                torch.where(better, error, best.error),
            )
        levels, codes = stored, new_codes
    return best


def _dequantized(levels: Tensor, codes: Tensor, weight: Tensor, exact: Tensor | None) -> Tensor:
    """float32 (R, N): levels[codes], the ``exact`` (sparse) positions holding their weight."""
    values = levels.gather(1, codes)
    return values if exact is None else torch.where(exact, weight, values)


__all__ = [
    "DEFAULT_DAMP",
    "DEFAULT_BLOCK",
    "inverse_hessian_factor",
    "compensated_codes",
    "refit_lut",
    "Refit",
    "refitted_codes",
    "row_errors",
    "row_groups",
]
