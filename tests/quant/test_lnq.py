"""The LUT refit against the Fisher-weighted loss (squeeze.quant.lnq, squeeze.quant.schemes.lut_lnq)."""

from __future__ import annotations

import itertools

import pytest
import torch

from squeeze.quant.kmeans import weighted_kmeans_1d
from squeeze.quant.lnq import correlation, descend_codes, lnq_refit, objective, refit_levels, row_scales
from squeeze.quant.schemes.lut import Lut8Weight, quantize_lut
from squeeze.quant.schemes.lut_lnq import refit_against_loss
from squeeze.quant.sparse import select_sparse


def inputs(tokens: int, cols: int, seed: int) -> torch.Tensor:
    """(tokens, cols) correlated inputs: a rank-8 signal plus noise, columns of different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=g) @ torch.randn(8, cols, generator=g) + 0.3 * torch.randn(
        tokens, cols, generator=g
    )
    return x * (0.2 + torch.rand(cols, generator=g))


def layer(rows: int = 24, cols: int = 64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(weight, fisher, fitted H, held-out H): the two Hessians from different tokens of one distribution."""
    g = torch.Generator().manual_seed(seed + 100)
    x_fit, x_hold = inputs(256, cols, seed), inputs(256, cols, seed)  # same mixing (seed), other tokens below
    x_hold = x_hold + 0.3 * torch.randn(x_hold.shape, generator=g)
    w = 0.05 * torch.randn(rows, cols, generator=g)
    grad2 = torch.rand(rows, 1, generator=g) + 0.1
    fisher = grad2 * (x_fit**2).mean(dim=0)[None, :] * (0.5 + torch.rand(rows, cols, generator=g))
    return w, fisher, x_fit.T @ x_fit, x_hold.T @ x_hold


def half(levels: torch.Tensor) -> torch.Tensor:
    return levels.to(torch.float16).to(torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_refit_never_raises_the_held_out_objective_of_any_row(seed):
    w, f, h, hold = layer(seed=seed)
    levels, codes = weighted_kmeans_1d(w, f, 8, centroid_dtype=torch.float16)
    levels = levels.to(torch.float32)
    scale, hold_c = row_scales(f, w.shape), correlation(hold)
    start = objective(w, levels.gather(1, codes.long()), scale, hold_c)
    out = lnq_refit(w, levels, codes.long(), f, h, hold, half, rounds=3, ridge=0.1, shrink=0.1)
    end = objective(w, out.levels.gather(1, out.codes), scale, hold_c)
    assert bool((end <= start).all())
    assert out.after <= out.before
    assert out.before == pytest.approx(float(start.sum()))
    assert out.after == pytest.approx(float(end.sum()))
    # rows that kept round 0 are the k-means pair exactly
    kept = out.round == 0
    assert torch.equal(out.codes[kept], codes.long()[kept])
    assert torch.equal(out.levels[kept], levels[kept])
    # and on this correlated layer the refit does pay: most rows move, the held-out objective falls clearly
    assert int((~kept).sum()) > w.shape[0] // 2
    assert out.after < 0.9 * out.before
    assert out.fit_after < out.fit_before


def test_a_held_out_set_that_disagrees_keeps_the_k_means_pair():
    """Fitted to one correlation, judged by the opposite one: every iterate loses there, so nothing moves."""
    w, f, h, _ = layer(seed=5)
    levels, codes = weighted_kmeans_1d(w, f, 8, centroid_dtype=torch.float16)
    levels = levels.to(torch.float32)
    # the held-out "Hessian": the fit's correlations negated off the diagonal (PSD only up to shrinkage)
    c = correlation(h)
    anti = 2 * torch.eye(c.shape[0], dtype=torch.float64) - c
    d = torch.diagonal(h).to(torch.float64).sqrt()
    hold = (anti * d[:, None] * d[None, :]).to(torch.float32)
    out = lnq_refit(w, levels, codes.long(), f, h, hold, half, rounds=2, ridge=0.0, shrink=0.0)
    assert out.after <= out.before
    changed = out.round > 0
    assert int(changed.sum()) < w.shape[0]  # some rows lose on this held-out objective and keep k-means
    assert torch.equal(out.codes[~changed], codes.long()[~changed])


def test_the_closed_form_refit_recovers_known_levels():
    """Weights that are exactly a LUT's values: the refit finds that LUT from any anchor (ridge 0)."""
    g = torch.Generator().manual_seed(3)
    rows, cols, k = 6, 40, 8
    truth = torch.randn(rows, k, generator=g, dtype=torch.float64).sort(dim=1).values
    codes = torch.stack([torch.randperm(cols, generator=g) % k for _ in range(rows)])  # every level used
    w = truth.gather(1, codes)
    _, f, h, _ = layer(rows, cols, seed=3)
    fitted = refit_levels(w, codes, row_scales(f, w.shape), correlation(h, 0.1), torch.zeros(rows, k), ridge=0.0)
    torch.testing.assert_close(fitted, truth, rtol=1e-9, atol=1e-9)


def test_the_closed_form_refit_solves_the_ridge_problem():
    """Differential check against the explicit per-row least squares (stacked: sqrt(Hf) (w - E l), ridge rows)."""
    w, f, h, _ = layer(rows=5, cols=32, seed=4)
    levels, codes = weighted_kmeans_1d(w, f, 4)
    scale, corr, ridge = row_scales(f, w.shape), correlation(h, 0.2), 0.3
    fitted = refit_levels(w, codes.long(), scale, corr, levels, ridge)
    for r in range(w.shape[0]):
        e = torch.nn.functional.one_hot(codes[r].long(), 4).to(torch.float64)  # (N, K)
        s = scale[r]
        hf = s[:, None] * corr * s[None, :]
        root = torch.linalg.cholesky(hf + 1e-12 * torch.eye(len(s), dtype=torch.float64)).T  # hf = root^T root
        mass = ((e * s[:, None]) ** 2).sum(dim=0)
        a = torch.cat([root @ e, torch.diag((ridge * mass).sqrt())])
        b = torch.cat([root @ w[r].to(torch.float64), (ridge * mass).sqrt() * levels[r].to(torch.float64)])
        expected = torch.linalg.lstsq(a, b[:, None]).solution.squeeze(1)
        torch.testing.assert_close(fitted[r], expected, rtol=1e-6, atol=1e-9)


def test_coordinate_descent_never_raises_the_objective_and_is_a_local_optimum():
    w, f, h, _ = layer(rows=8, cols=48, seed=6)
    levels, codes = weighted_kmeans_1d(w, f, 4)
    scale, corr = row_scales(f, w.shape), correlation(h, 0.1)
    lv = levels.to(torch.float64)
    start = objective(w, lv.gather(1, codes.long()), scale, corr)
    new = descend_codes(w, lv, codes.long(), scale, corr)
    end = objective(w, lv.gather(1, new), scale, corr)
    assert bool((end <= start + 1e-12).all())
    assert float(end.sum()) < float(start.sum())
    # with the correlations gone (identity), one sweep is the nearest level: the k-means assignment
    nearest = descend_codes(w, lv, codes.long(), scale, torch.eye(w.shape[1], dtype=torch.float64))
    assert torch.equal(nearest, (w[:, :, None] - levels[:, None, :]).abs().argmin(dim=2))


def test_brute_force_agrees_on_a_tiny_row():
    """2 levels, 6 columns: sweeps repeated until the codes stop changing give a pair that no single code change
    improves (a fixed point of the sweep is a coordinate optimum), and the sweeps' objective never rose."""
    w, f, h, _ = layer(rows=1, cols=6, seed=7)
    lv = torch.tensor([[-0.03, 0.04]], dtype=torch.float64)
    scale, corr = row_scales(f, w.shape), correlation(h)
    codes = torch.zeros(1, 6, dtype=torch.int64)
    seen = [float(objective(w, lv.gather(1, codes), scale, corr))]
    for _ in range(20):
        new = descend_codes(w, lv, codes, scale, corr)
        seen.append(float(objective(w, lv.gather(1, new), scale, corr)))
        if torch.equal(new, codes):
            break
        codes = new
    assert torch.equal(new, codes)
    assert all(b <= a + 1e-15 for a, b in itertools.pairwise(seen))
    best = float(objective(w, lv.gather(1, codes), scale, corr))
    for c, v in itertools.product(range(6), range(2)):
        other = codes.clone()
        other[0, c] = v
        assert float(objective(w, lv.gather(1, other), scale, corr)) >= best - 1e-15


@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
@pytest.mark.parametrize("sparse", [False, True])
def test_the_format_glue_keeps_format_sparse_part_and_the_guarantee(lut_dtype, sparse):
    w, f, h, hold = layer(rows=16, cols=64, seed=8)
    mask = select_sparse(w, f, 0.01, 0.02) if sparse else None
    plain = quantize_lut(w, f, 3, mask=mask, lut_dtype=lut_dtype)
    fm = f.masked_fill(mask, 0.0) if mask is not None else f
    out, report = refit_against_loss(plain, w, fm, h, hold, rounds=2, mask=mask)
    assert type(out) is type(plain) and isinstance(out, Lut8Weight) == (lut_dtype == "int8")
    assert out.bits == plain.bits and out.storage_bits() == plain.storage_bits()
    assert bool((out.lut_values()[:, 1:] >= out.lut_values()[:, :-1]).all())  # ascending, as stored
    scale, hold_c = row_scales(fm, w.shape, mask), correlation(hold)
    before = objective(w, plain.dequantize(), scale, hold_c)
    after = objective(w, out.dequantize(), scale, hold_c)
    assert float(after.sum()) <= float(before.sum()) * (1 + 1e-6)
    assert report.after <= report.before
    if mask is not None:
        assert torch.equal(out.dequantize()[mask], w[mask])  # the sparse part is untouched


def test_bad_arguments_are_refused():
    w, f, h, hold = layer(rows=4, cols=16)
    levels, codes = weighted_kmeans_1d(w, f, 4)
    with pytest.raises(ValueError, match="shrink"):
        correlation(h, 1.5)
    with pytest.raises(ValueError, match="square"):
        correlation(h[:3])
    with pytest.raises(ValueError, match="rounds and ridge"):
        lnq_refit(w, levels, codes.long(), f, h, hold, half, rounds=-1, ridge=0.1, shrink=0.1)
    with pytest.raises(ValueError, match="Hessians"):
        lnq_refit(w, levels, codes.long(), f, h[:8, :8], hold, half, rounds=1, ridge=0.1, shrink=0.1)
