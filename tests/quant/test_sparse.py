"""Dense-and-sparse split: exact counts, deterministic ties, CSR round trip and validation."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import FormatError, ModelError
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.sparse import SparseCSR, select_sparse


def data(rows: int = 16, cols: int = 172, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02, torch.rand(rows, cols, generator=g)


@pytest.mark.parametrize(
    ("sensitive", "outlier"), [(0.0, 0.0), (0.0005, 0.004), (0.01, 0.0), (0.0, 0.02), (0.05, 0.05), (0.3, 0.7)]
)
def test_exact_counts(sensitive: float, outlier: float) -> None:
    weight, fisher = data()
    mask = select_sparse(weight, fisher, sensitive, outlier)
    assert mask.dtype == torch.bool and mask.shape == weight.shape
    assert int(mask.sum()) == round(sensitive * weight.numel()) + round(outlier * weight.numel())


def test_sensitive_then_outliers_disjoint_and_ranked() -> None:
    weight, fisher = data(8, 50, seed=1)
    fisher = fisher + weight.abs() * 100  # the most sensitive weights are also the largest ones
    n = weight.numel()
    n_s, n_o = round(0.04 * n), round(0.06 * n)
    mask = select_sparse(weight, fisher, 0.04, 0.06)
    sensitive = torch.zeros(n, dtype=torch.bool)
    sensitive[torch.argsort(fisher.view(-1), descending=True, stable=True)[:n_s]] = True
    rest = weight.view(-1).abs().masked_fill(sensitive, -1.0)
    outliers = torch.zeros(n, dtype=torch.bool)
    outliers[torch.argsort(rest, descending=True, stable=True)[:n_o]] = True
    assert not bool((sensitive & outliers).any())
    assert torch.equal(mask.view(-1), sensitive | outliers)
    assert int(mask.sum()) == n_s + n_o  # no position counted twice


def test_ties_break_by_lowest_flat_index() -> None:
    weight = torch.zeros(3, 4)
    assert select_sparse(weight, None, 0.0, 0.25).view(-1).nonzero().view(-1).tolist() == [0, 1, 2]
    fisher = torch.ones(3, 4)
    weight = torch.ones(3, 4)
    mask = select_sparse(weight, fisher, 2 / 12, 3 / 12)
    assert mask.view(-1).nonzero().view(-1).tolist() == [0, 1, 2, 3, 4]


def test_no_fisher_means_no_sensitive_part() -> None:
    weight, _ = data()
    mask = select_sparse(weight, None, 0.05, 0.01)
    assert int(mask.sum()) == round(0.01 * weight.numel())
    top = weight.view(-1).abs().argsort(descending=True, stable=True)[: int(mask.sum())]
    assert mask.view(-1)[top].all()


def test_select_rejects_bad_input() -> None:
    weight, fisher = data(2, 5)
    with pytest.raises(ValueError, match="exceed"):
        select_sparse(weight, fisher, 0.6, 0.5)
    with pytest.raises(ValueError, match="outlier_fraction"):
        select_sparse(weight, fisher, 0.0, -0.1)
    with pytest.raises(ValueError, match="fisher must match"):
        select_sparse(weight, fisher[:, :3], 0.1, 0.0)
    bad = weight.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ModelError, match="NaN"):
        select_sparse(bad, fisher, 0.1, 0.1)


# ------------------------------------------------------------------------------------------------------
# CSR


def test_csr_from_mask_round_trip_and_storage_bits() -> None:
    weight, fisher = data(5, 40)
    mask = select_sparse(weight, fisher, 0.05, 0.05)
    csr = SparseCSR.from_mask(mask, weight)
    nnz = int(mask.sum())
    assert csr.nnz == nnz and csr.shape == (5, 40)
    assert csr.rowptr.dtype == torch.int32 and csr.rowptr.tolist()[-1] == nnz
    assert csr.cols.dtype == torch.int16 and csr.vals.dtype == weight.dtype
    back_mask, back_vals = csr.to_dense_mask_and_values()
    assert torch.equal(back_mask, mask)
    assert torch.equal(back_vals[mask], weight[mask])
    assert csr.storage_bits() == 6 * 32 + nnz * (16 + 32)
    csr.validate(5, 40)


def test_csr_keeps_the_weight_dtype_and_wide_matrices_use_int32_cols() -> None:
    weight = torch.randn(1, 40000).to(torch.bfloat16)
    mask = torch.zeros(1, 40000, dtype=torch.bool)
    mask[0, [3, 39999]] = True
    csr = SparseCSR.from_mask(mask, weight)
    assert csr.cols.dtype == torch.int32 and csr.vals.dtype == torch.bfloat16
    assert csr.storage_bits() == 2 * 32 + 2 * (32 + 16)
    csr.validate(1, 40000)


def test_scatter_replaces_values() -> None:
    mask = torch.tensor([[True, False, False], [False, False, True]])
    values = torch.tensor([[1e-4, 0.0, 0.0], [0.0, 0.0, -3.5]])
    dense = torch.full((2, 3), 0.01)
    out = SparseCSR.from_mask(mask, values).scatter_into(dense)
    assert out is dense
    expected = torch.tensor([[1e-4, 0.01, 0.01], [0.01, 0.01, -3.5]])  # replaced, not added
    assert torch.equal(out, expected)


def test_replace_semantics_are_bit_exact_after_dequantize() -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 172, generator=g) * 0.02
    weight[2, 17] = 1.2345e-4  # tiny weight next to ~0.01 centroids: a residual could not restore it
    fisher = torch.rand(6, 172, generator=g)
    fisher[2, 17] = 1e6  # certainly selected as sensitive
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = weight.to(dtype)
        q = quantize_lut(w, fisher, 3, sensitive_fraction=0.002, outlier_fraction=0.01)
        assert q.sparse is not None and q.sparse.vals.dtype == dtype
        mask, _ = q.sparse.to_dense_mask_and_values()
        assert bool(mask[2, 17])
        deq = q.dequantize(dtype)
        assert torch.equal(deq[mask], w[mask])
        assert deq[2, 17].item() == w[2, 17].item()


def make_csr(rowptr: list[int], cols: list[int], vals: list[float], shape: tuple[int, int]) -> SparseCSR:
    col_dtype = SparseCSR.col_dtype(shape[1])
    return SparseCSR(
        rowptr=torch.tensor(rowptr, dtype=torch.int32),
        cols=torch.tensor(cols, dtype=col_dtype),
        vals=torch.tensor(vals, dtype=torch.float32),
        shape=shape,
    )


def test_validate_accepts_a_good_csr() -> None:
    make_csr([0, 2, 2, 3], [0, 4, 1], [1.0, 2.0, 3.0], (3, 5)).validate(3, 5)
    make_csr([0, 0], [], [], (1, 5)).validate(1, 5)


@pytest.mark.parametrize(
    ("rowptr", "cols", "vals", "message"),
    [
        ([0, 2, 1, 3], [0, 4, 1], [1.0, 2.0, 3.0], "non-decreasing"),
        ([0, 2, 2, 3], [0, 5, 1], [1.0, 2.0, 3.0], r"in \[0, 5\)"),
        ([0, 2, 2, 3], [0, -1, 1], [1.0, 2.0, 3.0], r"in \[0, 5\)"),
        ([0, 2, 2, 3], [0, 4, 1], [1.0, 2.0], "same length"),
        ([0, 2, 3], [0, 4, 1], [1.0, 2.0, 3.0], "length 4"),
        ([1, 2, 2, 3], [0, 4, 1], [1.0, 2.0, 3.0], "start at 0"),
        ([0, 2, 2, 2], [0, 4, 1], [1.0, 2.0, 3.0], "end at nnz"),
        ([0, 2, 2, 3], [4, 4, 1], [1.0, 2.0, 3.0], "strictly ascending"),
        ([0, 2, 2, 3], [4, 0, 1], [1.0, 2.0, 3.0], "strictly ascending"),
    ],
)
def test_validate_rejects_malformed_csr(rowptr: list[int], cols: list[int], vals: list[float], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        make_csr(rowptr, cols, vals, (3, 5)).validate(3, 5)


def test_validate_rejects_wrong_dtypes_and_shape() -> None:
    good = make_csr([0, 1], [2], [1.0], (1, 5))
    with pytest.raises(FormatError, match="int32"):
        SparseCSR(good.rowptr.long(), good.cols, good.vals, (1, 5)).validate(1, 5)
    with pytest.raises(FormatError, match="int16"):
        SparseCSR(good.rowptr, good.cols.int(), good.vals, (1, 5)).validate(1, 5)
    with pytest.raises(FormatError, match="floating"):
        SparseCSR(good.rowptr, good.cols, good.vals.long(), (1, 5)).validate(1, 5)
    with pytest.raises(FormatError, match="shape"):
        good.validate(1, 6)
