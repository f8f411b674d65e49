"""Error-compensated LUT quantization (squeeze.quant.ec, LutWeight.quantize with error_compensation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from squeeze.quant.ec import (
    cached_inverse_hessian_factor,
    compensated_codes,
    inverse_hessian_factor,
    refit_lut,
    refitted_codes,
    row_errors,
    row_groups,
)
from squeeze.quant.schemes.lut import Lut8Weight, LutWeight, compensate_lut, quantize_lut
from squeeze.quant.sparse import select_sparse


def correlated_inputs(tokens: int, cols: int, seed: int = 0) -> torch.Tensor:
    """(tokens, cols) inputs with strongly correlated columns (a rank-16 signal plus a little noise)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 16, generator=g) @ torch.randn(16, cols, generator=g) + 0.2 * torch.randn(
        tokens, cols, generator=g
    )


def weight(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    return 0.05 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float(((x @ w.T - x @ q.T) ** 2).sum())


def reference_codes(w: torch.Tensor, grid: torch.Tensor, h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Optimal Brain Surgeon, one column at a time, in float64, without Cholesky or blocks (GPTQ's eq. 2/3):
    quantize column j, spread its error over the remaining columns by Hinv[j, :] / Hinv[j, j], then remove j
    from the inverse (Gaussian elimination)."""
    w = w.to(torch.float64).clone()
    h = h.to(torch.float64).clone()
    n = h.shape[0]
    h += damp * torch.diagonal(h).mean() * torch.eye(n, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    g = grid.to(torch.float64)
    codes = torch.empty(w.shape, dtype=torch.int64)
    for j in range(n):
        code = (w[:, j : j + 1] - g).abs().argmin(dim=1)
        codes[:, j] = code
        err = (w[:, j] - g.gather(1, code[:, None]).squeeze(1)) / hinv[j, j]
        w[:, j:] -= err[:, None] * hinv[j, j:][None, :]
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return codes


def options(bits: int = 3, **changes: object) -> SimpleNamespace:
    base = {
        "bits": bits,
        "group_size": None,
        "sensitive_fraction": 0.0,
        "outlier_fraction": 0.0,
        "lut_dtype": "float16",
        "error_compensation": True,
        "damp": 0.01,
        "refit_lut": False,
    }
    return SimpleNamespace(**(base | changes))


def test_identity_hessian_gives_plain_nearest_lut_codes_bit_for_bit():
    w = weight(48, 96)
    plain = quantize_lut(w, None, 3)
    ec = compensate_lut(plain, w, torch.eye(96))
    assert torch.equal(ec.packed, plain.packed) and torch.equal(ec.lut, plain.lut)
    # a diagonal H couples no columns either, whatever its scale
    diag = compensate_lut(plain, w, torch.diag(torch.linspace(0.5, 3.0, 96)))
    assert torch.equal(diag.packed, plain.packed)


def test_codes_match_the_unblocked_obs_reference():
    x = correlated_inputs(512, 80)
    w = weight(24, 80)
    h = x.T @ x
    plain = quantize_lut(w, None, 3)
    grid = plain.lut_values()
    ours = compensated_codes(w, grid, h, block_size=32)  # 80 columns: two full blocks and a partial one
    ref = reference_codes(w, grid, h)
    assert float((ours == ref).double().mean()) >= 0.99  # float32 vs float64: near-ties may flip
    # and the block size does not change the result beyond rounding
    assert float((compensated_codes(w, grid, h, block_size=7) == ours).double().mean()) >= 0.99


@pytest.mark.parametrize("bits", [3, 4])
def test_compensation_cuts_the_output_error_on_correlated_inputs(bits):
    x = correlated_inputs(1024, 128)
    w = weight(64, 128)
    plain = quantize_lut(w, None, bits)
    ec = compensate_lut(plain, w, x.T @ x)
    before, after = output_error(x, w, plain.dequantize()), output_error(x, w, ec.dequantize())
    assert after < 0.25 * before, (before, after)
    refit = compensate_lut(plain, w, x.T @ x, refit=True)
    assert output_error(x, w, refit.dequantize()) <= after * 1.02
    lut = refit.lut.to(torch.float32)
    assert refit.lut.dtype == torch.float16 and bool((lut[:, 1:] >= lut[:, :-1]).all())  # still ascending


def test_sparse_positions_stay_exact_and_are_never_updated():
    x = correlated_inputs(512, 64)
    w = weight(32, 64)
    w[3, 5] = 0.9  # an outlier the sparse part takes
    fisher = torch.rand(32, 64, generator=torch.Generator().manual_seed(2))
    mask = select_sparse(w, fisher, 0.02, 0.03)
    plain = quantize_lut(w, fisher, 3, mask=mask)
    ec = compensate_lut(plain, w, x.T @ x, mask=mask)
    deq = ec.dequantize()
    assert torch.equal(deq[mask], w[mask])  # bit-exact, as stored
    assert ec.sparse is plain.sparse
    # "never updated": the compensation treats sparse positions as fixed at their value, so giving the sparse
    # weights any other value changes no code outside them
    moved = w.clone()
    moved[mask] += 0.37
    other = compensated_codes(moved, plain.lut_values(), x.T @ x, mask=mask)
    codes = compensated_codes(w, plain.lut_values(), x.T @ x, mask=mask)
    assert torch.equal(other[~mask], codes[~mask])
    assert output_error(x, w, deq) < output_error(x, w, plain.dequantize())


def test_dead_inputs_and_a_singular_hessian_work_with_dampening():
    x = correlated_inputs(256, 48)
    x[:, 7] = 0.0  # a dead input: H[7, :] = H[:, 7] = 0
    x[:, 9] = x[:, 8]  # two identical inputs: H is singular beyond the dead one
    h = x.T @ x
    assert int(torch.linalg.matrix_rank(h)) < 47
    w = weight(16, 48)
    plain = quantize_lut(w, None, 3)
    ec = compensate_lut(plain, w, h)
    assert torch.isfinite(ec.dequantize()).all()
    # the dead column is quantized as 0 would be (nothing it stores reaches the output)
    zero = (plain.lut_values()).abs().argmin(dim=1)
    assert torch.equal(ec.codes()[:, 7].to(torch.int64), zero)
    assert output_error(x, w, ec.dequantize()) < output_error(x, w, plain.dequantize())
    upper, dead = inverse_hessian_factor(h)
    assert dead.tolist() == [i == 7 for i in range(48)] and torch.isfinite(upper).all()
    # every input dead (H = 0): plain nearest rounding of zeros, nothing raised
    all_dead = compensated_codes(w, plain.lut_values(), torch.zeros(48, 48))
    assert bool((all_dead == zero[:, None]).all())


def test_bad_hessians_are_refused():
    w = weight(4, 8)
    grid = quantize_lut(w, None, 2).lut_values()
    with pytest.raises(ValueError, match="square"):
        inverse_hessian_factor(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        compensated_codes(w, grid, torch.eye(7))
    with pytest.raises(ValueError, match="NaN"):
        inverse_hessian_factor(torch.full((8, 8), float("nan")))
    with pytest.raises(ValueError, match="damp"):
        inverse_hessian_factor(torch.eye(8), damp=-1.0)


def test_lut_weight_quantize_with_error_compensation():
    x = correlated_inputs(512, 64)
    w = weight(32, 64)
    h = x.T @ x
    ec = LutWeight.quantize(w, None, options(), hessian=h)
    plain = LutWeight.quantize(w, None, options(error_compensation=False), hessian=h)
    assert type(ec) is LutWeight and torch.equal(ec.lut, plain.lut) and not torch.equal(ec.packed, plain.packed)
    assert output_error(x, w, ec.dequantize()) < output_error(x, w, plain.dequantize())
    ec8 = LutWeight.quantize(w, None, options(lut_dtype="int8"), hessian=h)
    assert type(ec8) is Lut8Weight
    plain8 = quantize_lut(w, None, 3, lut_dtype="int8")
    assert output_error(x, w, ec8.dequantize()) < output_error(x, w, plain8.dequantize())
    with pytest.raises(ValueError, match="Hessian"):
        LutWeight.quantize(w, None, options())


def test_the_factor_is_reused_only_for_the_same_unmodified_hessian():
    x = correlated_inputs(256, 32)
    h = x.T @ x
    first = cached_inverse_hessian_factor(h)
    assert cached_inverse_hessian_factor(h) is first  # q, k, v in a row: one Cholesky
    assert cached_inverse_hessian_factor(h, act_order=True) is not first
    assert cached_inverse_hessian_factor(h, damp=0.1) is not first
    h.mul_(2.0)  # changed in place: recomputed
    again = cached_inverse_hessian_factor(h)
    assert again is not first
    torch.testing.assert_close(again[0], inverse_hessian_factor(h)[0])
    assert cached_inverse_hessian_factor(h.clone()) is not again


def test_act_order_is_the_plain_run_on_columns_sorted_by_descending_diag_h():
    x = correlated_inputs(512, 40) * torch.linspace(0.2, 3.0, 40)  # distinct input scales: a real reordering
    w = weight(12, 40)
    h = x.T @ x
    grid = quantize_lut(w, None, 3).lut_values()
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    assert not torch.equal(order, torch.arange(40))
    permuted = compensated_codes(w[:, order], grid, h[order][:, order].contiguous())
    ours = compensated_codes(w, grid, h, act_order=True)
    assert torch.equal(ours[:, order], permuted)


def test_the_recipe_act_order_key_reaches_the_column_order():
    x = correlated_inputs(512, 40) * torch.linspace(0.2, 3.0, 40)
    w, h = weight(12, 40), x.T @ x
    plain = quantize_lut(w, None, 3)
    by_recipe = LutWeight.quantize(w, None, options(act_order=True), hessian=h)
    assert torch.equal(by_recipe.packed, compensate_lut(plain, w, h, act_order=True).packed)
    assert not torch.equal(by_recipe.packed, compensate_lut(plain, w, h).packed)


def test_row_groups_split_contiguously_and_as_evenly_as_possible():
    assert row_groups(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert row_groups(4, 4) == [slice(i, i + 1) for i in range(4)]
    assert row_groups(5, 1) == [slice(0, 5)]
    with pytest.raises(ValueError, match="groups must be >= 1"):
        row_groups(5, 0)


def test_grouped_hessians_compensate_each_row_group_against_its_own():
    x = correlated_inputs(256, 24)
    w = weight(10, 24)
    plain = quantize_lut(w, None, 3)
    grid = plain.lut_values()
    scales = torch.tensor([0.5, 2.0, 7.0])[:, None]
    # three different Hessians: the same inputs with tokens re-weighted per group
    token_weights = torch.rand(3, 256, generator=torch.Generator().manual_seed(3))
    hs = torch.stack([(x * tw[:, None]).T @ x for tw in token_weights]) * scales[:, :, None]
    codes = compensated_codes(w, grid, hs)
    expected = torch.cat(
        [compensated_codes(w[r], grid[r], hs[g]) for g, r in enumerate(row_groups(10, 3))],
    )
    assert torch.equal(codes, expected)
    # one group is the 2-D Hessian itself
    h = x.T @ x
    assert torch.equal(compensated_codes(w, grid, h[None]), compensated_codes(w, grid, h))
    # and grouping matters: each group's rows differ from compensating them all against group 0's Hessian
    assert not torch.equal(codes, compensated_codes(w, grid, hs[0]))


def test_grouped_refit_equals_the_per_group_refits():
    x = correlated_inputs(256, 24)
    w = weight(9, 24)
    plain = quantize_lut(w, None, 3)
    hs = torch.stack([x.T @ x, (2 * x).T @ (0.5 * x + 0.1), x.T @ x * 3])
    hs = (hs + hs.transpose(1, 2)) / 2
    codes = compensated_codes(w, plain.lut_values(), hs)
    fitted = refit_lut(w, codes, hs, 8)
    expected = torch.cat([refit_lut(w[r], codes[r], hs[g], 8) for g, r in enumerate(row_groups(9, 3))])
    torch.testing.assert_close(fitted, expected)
    out = compensate_lut(plain, w, hs, refit=True)  # the LutWeight path takes the grouped Hessians too
    assert out.dequantize().shape == w.shape


def _fp16(levels: torch.Tensor) -> torch.Tensor:
    return levels.to(torch.float16).to(torch.float32)


@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
def test_refit_rounds_are_never_worse_per_row_and_better_in_all(lut_dtype):
    x = correlated_inputs(1024, 96)
    w = weight(40, 96)
    h = x.T @ x
    plain = quantize_lut(w, None, 3, lut_dtype=lut_dtype)
    base = compensate_lut(plain, w, h, act_order=True, damp=0.1)
    before = row_errors(w, base.dequantize(), h)
    errors = [before]
    for rounds in (1, 2, 4):
        out = compensate_lut(plain, w, h, act_order=True, damp=0.1, refit_rounds=rounds)
        assert type(out) is type(plain)
        lut = out.lut_values()
        assert bool((lut[:, 1:] >= lut[:, :-1]).all())  # still ascending, as the format stores it
        errors.append(row_errors(w, out.dequantize(), h))
        assert bool((errors[-1] <= before).all())  # the invariant: every row no worse than compensation alone
        assert bool((errors[-1] <= errors[-2] * (1 + 1e-9)).all())  # more rounds: each row keeps its best
    assert float(errors[-1].sum()) < 0.7 * float(before.sum())  # and the alternation pays: 0.37x measured


def test_refit_rounds_zero_is_the_compensation_bit_for_bit_and_rows_of_round_zero_keep_their_lut():
    x = correlated_inputs(512, 48)
    w = weight(16, 48)
    h = x.T @ x
    plain = quantize_lut(w, None, 3)
    base = compensate_lut(plain, w, h)
    assert torch.equal(compensate_lut(plain, w, h, refit_rounds=0).packed, base.packed)
    best = refitted_codes(w, plain.lut_values(), h, _fp16, rounds=2)
    assert torch.equal(best.codes[best.round == 0], compensated_codes(w, plain.lut_values(), h)[best.round == 0])
    out = compensate_lut(plain, w, h, refit_rounds=2)
    kept = best.round == 0
    assert torch.equal(out.lut[kept], plain.lut[kept]) and bool((best.round > 0).any())
    torch.testing.assert_close(row_errors(w, out.dequantize(), h), best.error)


def test_refit_rounds_keep_sparse_positions_exact_and_take_grouped_hessians():
    x = correlated_inputs(512, 64)
    w = weight(30, 64)
    w[3, 5] = 0.9
    fisher = torch.rand(30, 64, generator=torch.Generator().manual_seed(2))
    mask = select_sparse(w, fisher, 0.02, 0.03)
    plain = quantize_lut(w, fisher, 3, mask=mask)
    h = x.T @ x
    out = compensate_lut(plain, w, h, mask=mask, refit_rounds=3)
    assert torch.equal(out.dequantize()[mask], w[mask]) and out.sparse is plain.sparse
    assert bool(
        (
            row_errors(w, out.dequantize(), h) <= row_errors(w, compensate_lut(plain, w, h, mask=mask).dequantize(), h)
        ).all()
    )
    hs = torch.stack([h, 2 * h + torch.diag(torch.linspace(0, 5, 64)), h * 0.5])
    grouped = compensate_lut(plain, w, hs, mask=mask, refit_rounds=2)
    parts = [
        compensate_lut(quantize_lut(w[r], fisher[r], 3, mask=mask[r]), w[r], hs[g], mask=mask[r], refit_rounds=2)
        for g, r in enumerate(row_groups(30, 3))
    ]
    assert torch.equal(grouped.packed, torch.cat([p.packed for p in parts]))
    assert torch.equal(grouped.lut, torch.cat([p.lut for p in parts]))


def test_refit_of_a_row_with_one_distinct_value_and_a_singular_hessian_stays_finite():
    x = correlated_inputs(64, 32)
    x[:, 4] = 0.0  # a dead input
    x[:, 6] = x[:, 5]  # and a singular H beyond it
    h = x.T @ x
    w = weight(6, 32)
    w[2] = 0.25  # one distinct value: a single used level
    plain = quantize_lut(w, None, 3)
    base = compensate_lut(plain, w, h)
    out = compensate_lut(plain, w, h, refit_rounds=3)
    assert torch.isfinite(out.lut_values()).all() and torch.isfinite(out.dequantize()).all()
    assert bool((row_errors(w, out.dequantize(), h) <= row_errors(w, base.dequantize(), h)).all())
    assert float(row_errors(w, out.dequantize(), h)[2]) <= 1e-6  # the constant row: represented exactly


def test_a_refit_that_is_not_finite_as_stored_keeps_the_rows_levels():
    x = correlated_inputs(512, 40)
    w, h = weight(8, 40), x.T @ x
    grid = quantize_lut(w, None, 3).lut_values()

    def overflow_row_1(levels: torch.Tensor) -> torch.Tensor:  # a format that cannot store row 1's refit
        stored = _fp16(levels)
        stored[1, 0] = float("inf")
        return stored

    best = refitted_codes(w, grid, h, overflow_row_1, rounds=3)
    assert int(best.round[1]) == 0 and torch.equal(best.stored[1], grid[1])
    assert torch.isfinite(best.stored).all() and bool((best.round > 0).any())
    with pytest.raises(ValueError, match="rounds"):
        refitted_codes(w, grid, h, _fp16, rounds=-1)


def test_refit_lut_marks_a_level_that_is_not_finite_in_float32_as_nan():
    # row 0: one level for two nearly collinear inputs; its least-squares value (-2.7e39) overflows float32
    h = torch.tensor([[1.0, -0.9], [-0.9, 0.82]])
    w = torch.tensor([[-3e38, 3e38], [0.1, 0.3]])
    fitted = refit_lut(w, torch.tensor([[0, 0], [0, 1]]), h, 2, damp=0.0)
    assert bool(torch.isnan(fitted[0]).all())  # the caller keeps that row's levels
    torch.testing.assert_close(fitted[1], torch.tensor([0.1, 0.3]))  # exactly representable: fitted exactly
