"""Stacking weights by rows (the vLLM plugin fuses q/k/v and gate/up into one runtime module): generic over the
formats' role descriptions, bit-exact, with CSR row pointers offset and a missing sparse part filled in."""

from __future__ import annotations

import pytest
import torch

from squeeze.config import WeightsConfig
from squeeze.quant.schemes import Lut8Weight, LutWeight, RtnWeight, WeightFormat
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.loader import quantized_weight_from

COLS = 19


def lut(rows: int, bits: int, lut_dtype: str, sparse: bool, seed: int) -> LutWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, COLS, generator=g)
    mask = torch.rand(rows, COLS, generator=g) < 0.2 if sparse else None
    return quantize_lut(w, torch.rand(rows, COLS, generator=g), bits, mask=mask, lut_dtype=lut_dtype)


def checked(q: WeightFormat) -> WeightFormat:
    """Through the artifact's tensors with every check (a well-formed CSR among them)."""
    return quantized_weight_from(q.to_tensors("m"), "m", q.module_spec())


@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_lut_parts_stack_bit_exactly_with_and_without_sparse_parts(bits: int, lut_dtype: str) -> None:
    parts = [lut(5, bits, lut_dtype, True, 0), lut(2, bits, lut_dtype, False, 1), lut(3, bits, lut_dtype, True, 2)]
    whole = type(parts[0]).cat_rows(parts)
    assert type(whole) is (Lut8Weight if lut_dtype == "int8" else LutWeight)
    assert whole.out_features == 10 and whole.sparse is not None
    assert whole.sparse.nnz == sum(p.sparse.nnz for p in parts if p.sparse is not None)
    expected = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(whole.dequantize(), expected)
    assert torch.equal(checked(whole).dequantize(), expected)


def test_parts_without_sparse_parts_stay_without() -> None:
    parts = [lut(3, 4, "float16", False, 0), lut(4, 4, "float16", False, 1)]
    whole = LutWeight.cat_rows(parts)
    assert whole.sparse is None
    assert torch.equal(whole.packed, torch.cat([p.packed for p in parts]))


def test_rtn_parts_stack() -> None:
    options = WeightsConfig(method="rtn", bits=4, group_size=8)
    parts = [RtnWeight.quantize(torch.randn(rows, 24), None, options) for rows in (3, 5)]
    whole = RtnWeight.cat_rows(parts)
    assert torch.equal(checked(whole).dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_parts_that_do_not_match_are_refused() -> None:
    with pytest.raises(ValueError, match="equal bits, in_features and parameters"):
        LutWeight.cat_rows([lut(2, 4, "float16", False, 0), lut(2, 3, "float16", False, 1)])
    with pytest.raises(ValueError, match="equal bits"):
        LutWeight.cat_rows([lut(2, 4, "float16", False, 0), lut(2, 4, "int8", False, 1)])
    with pytest.raises(ValueError, match="at least one"):
        LutWeight.cat_rows([])
