"""Column slices of weight formats (tensor-parallel row-parallel layers split their input columns).

Every slice must dequantize bit for bit like the same columns of the whole weight, survive the artifact
round trip, and cut packed codes anywhere (3-bit codes straddle bytes, 4-bit ones share them).
"""

from __future__ import annotations

import pytest
import torch

from squeeze.config import WeightsConfig
from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes import Lut8Weight, LutWeight, RtnWeight, WeightFormat
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.sparse import SparseCSR
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.loader import quantized_weight_from
from toy_format import ToyAbsmaxWeight

ROWS, COLS = 5, 21  # 21 columns: every start offset inside a 3-bit group of 8 codes, odd and even 4-bit columns


def lut_weight(bits: int, lut_dtype: str, sparse: bool, cols: int = COLS, seed: int = 0) -> LutWeight:
    """A quantized (ROWS, cols) bfloat16 weight; with ``sparse``: row 1 is all sparse (an entry at every start
    and stop - 1), row 2 has none, the others about a third of their columns."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(ROWS, cols, generator=g) * 0.02).to(torch.bfloat16)
    fisher = torch.rand(ROWS, cols, generator=g)
    mask = None
    if sparse:
        mask = torch.rand(ROWS, cols, generator=g) < 0.35
        mask[1] = True
        mask[2] = False
    q = quantize_lut(w, fisher, bits, mask=mask, lut_dtype=lut_dtype)
    assert type(q) is (Lut8Weight if lut_dtype == "int8" else LutWeight)
    assert (q.sparse is not None) == sparse
    return q


def round_trip(q: WeightFormat) -> WeightFormat:
    """Through the artifact tensors and module entry, with every check (values included)."""
    again = quantized_weight_from(q.to_tensors("m"), "m", q.module_spec())
    assert type(again) is type(q)
    return again


LUT_CASES = [(bits, lut_dtype) for bits in (2, 3, 4, 8) for lut_dtype in ("float16", "int8")]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("bits", "lut_dtype"), LUT_CASES)
def test_every_lut_column_slice_dequantizes_bit_identically(bits: int, lut_dtype: str, sparse: bool) -> None:
    q = lut_weight(bits, lut_dtype, sparse)
    dense = q.dequantize()
    for start in range(COLS + 1):
        for stop in range(start, COLS + 1):
            piece = q.col_slice(start, stop)
            assert type(piece) is type(q) and (piece.in_features, piece.out_features) == (stop - start, ROWS)
            assert torch.equal(piece.dequantize(), dense[:, start:stop]), (start, stop)
            # the repacked codes are exactly the slice's own packing (pad bits zero), stored contiguously
            assert torch.equal(piece.packed, pack_codes(q.codes()[:, start:stop].contiguous(), bits))
            assert piece.packed.is_contiguous()
            assert piece.lut is q.lut  # per row: unchanged
            if sparse:
                assert piece.sparse is not None and q.sparse is not None
                assert piece.sparse.vals.dtype == torch.bfloat16
                assert piece.sparse.cols.dtype == torch.int16 and piece.sparse.rowptr.dtype == torch.int32
                piece.sparse.validate(ROWS, stop - start)
                assert piece.sparse.nnz == int(((q.sparse.cols >= start) & (q.sparse.cols < stop)).sum())
            else:
                assert piece.sparse is None


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("bits", "lut_dtype"), LUT_CASES)
def test_lut_column_slices_round_trip_and_an_even_split_is_the_whole(bits: int, lut_dtype: str, sparse: bool) -> None:
    q = lut_weight(bits, lut_dtype, sparse, cols=24, seed=1)
    dense = q.dequantize(torch.bfloat16)
    for start, stop in ((0, 24), (1, 9), (3, 11), (5, 6), (23, 24), (7, 7)):
        piece = q.col_slice(start, stop)
        again = round_trip(piece)
        assert torch.equal(again.dequantize(torch.bfloat16), dense[:, start:stop])
        assert (getattr(again, "sparse", None) is not None) == sparse  # an empty sparse part stays a part
    for parts in (2, 3, 4, 8):
        width = 24 // parts
        pieces = [q.col_slice(i * width, (i + 1) * width).dequantize(torch.bfloat16) for i in range(parts)]
        assert torch.equal(torch.cat(pieces, dim=1), dense)


def test_a_row_parallel_split_sums_to_the_whole_product() -> None:
    q = lut_weight(3, "float16", sparse=True, cols=24)
    x = torch.randn(2, 24)
    shards = [SqueezeLinear(q.col_slice(a, a + 6))(x[:, a : a + 6]) for a in range(0, 24, 6)]
    assert torch.allclose(sum(shards), x @ q.dequantize().T, atol=1e-5)  # type: ignore[arg-type]


def test_golden_bytes_of_a_3_bit_slice_starting_mid_byte() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0], [7, 6, 5, 4, 3, 2, 1, 0]], dtype=torch.uint8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [2, 3, 6, 7]] = True  # both sides of each cut, and exactly at start and stop - 1
    values = torch.arange(16, dtype=torch.float32).view(2, 8) + 100
    q = LutWeight(
        bits=3,
        in_features=8,
        packed=pack_codes(codes, 3),
        lut=torch.arange(16, dtype=torch.float16).view(2, 8),
        sparse=SparseCSR.from_mask(mask, values),
    )
    piece = q.col_slice(3, 7)
    # codes 4, 5, 6, 7 LSB-first at stream bits 0, 3, 6, 9: byte 0 = 4 | 5 << 3 | (6 & 3) << 6 = 172,
    # byte 1 = 6 >> 2 | 7 << 1 = 15; row 1 (4, 3, 2, 1): 4 | 3 << 3 | 2 << 6 = 156, 0 | 1 << 1 = 2
    assert piece.packed.tolist() == [[172, 15], [156, 2]]
    assert piece.sparse is not None
    assert piece.sparse.rowptr.tolist() == [0, 2, 2]
    assert piece.sparse.cols.tolist() == [0, 3] and piece.sparse.vals.tolist() == [103.0, 106.0]
    assert piece.dequantize().tolist() == [[103.0, 5.0, 6.0, 106.0], [12.0, 11.0, 10.0, 9.0]]


def test_sparse_column_slice_uses_the_column_dtype_of_its_own_width() -> None:
    mask = torch.zeros(2, 40_000, dtype=torch.bool)
    mask[0, [0, 19_999, 20_000, 39_999]] = True
    mask[1, [5, 30_000]] = True
    csr = SparseCSR.from_mask(mask, torch.randn(2, 40_000, dtype=torch.float16))
    assert csr.cols.dtype == torch.int32
    right = csr.col_slice(20_000, 40_000)
    assert right.cols.dtype == torch.int16 and right.shape == (2, 20_000)
    assert right.cols.tolist() == [0, 19_999, 10_000] and right.rowptr.tolist() == [0, 2, 3]
    assert torch.equal(right.vals, csr.vals[[2, 3, 5]]) and right.vals.dtype == torch.float16
    right.validate(2, 20_000)
    empty = csr.col_slice(6, 19_999)
    assert empty.nnz == 0 and empty.rowptr.tolist() == [0, 0, 0] and empty.shape == (2, 19_993)
    empty.validate(2, 19_993)
    with pytest.raises(ValueError, match="start <= stop"):
        csr.col_slice(10, 9)


def test_a_wide_lut_slice_round_trips_with_int16_columns() -> None:
    g = torch.Generator().manual_seed(0)
    cols = 33_000
    codes = torch.randint(0, 4, (2, cols), generator=g, dtype=torch.uint8)
    mask = torch.rand(2, cols, generator=g) < 0.01
    q = LutWeight(
        bits=2,
        in_features=cols,
        packed=pack_codes(codes, 2),
        lut=torch.randn(2, 4, generator=g).sort(dim=1).values.to(torch.float16),
        sparse=SparseCSR.from_mask(mask, torch.randn(2, cols, generator=g)),
    )
    dense = q.dequantize()
    piece = q.col_slice(1_001, 17_501)
    again = round_trip(piece)
    assert isinstance(again, LutWeight) and again.sparse is not None and again.sparse.cols.dtype == torch.int16
    assert torch.equal(again.dequantize(), dense[:, 1_001:17_501])


def rtn(group_size: int | None, cols: int = 40) -> RtnWeight:
    g = torch.Generator().manual_seed(2)
    options = WeightsConfig(method="rtn", bits=3, group_size=group_size)
    q = RtnWeight.quantize(torch.randn(4, cols, generator=g), None, options)
    assert isinstance(q, RtnWeight)
    return q


@pytest.mark.parametrize(
    ("cols", "start", "stop"), [(40, 0, 40), (40, 0, 16), (40, 8, 40), (40, 16, 24), (37, 32, 37), (37, 8, 37)]
)
def test_rtn_slices_on_group_boundaries(cols: int, start: int, stop: int) -> None:
    q = rtn(8, cols)
    piece = q.col_slice(start, stop)
    assert piece.group_size == 8 and piece.scales.shape == (4, -(-(stop - start) // 8))
    assert torch.equal(piece.dequantize(), q.dequantize()[:, start:stop])
    assert torch.equal(round_trip(piece).dequantize(), q.dequantize()[:, start:stop])


@pytest.mark.parametrize(("start", "stop", "which"), [(3, 16, "start"), (8, 20, "stop"), (12, 13, "start")])
def test_rtn_slices_off_a_group_boundary_are_refused(start: int, stop: int, which: str) -> None:
    with pytest.raises(ValueError, match=f"must {which} on a group boundary .*group_size 8"):
        rtn(8).col_slice(start, stop)


def test_per_channel_rtn_slices_at_any_column() -> None:
    q = rtn(None, cols=37)
    loaded = round_trip(q)  # an artifact spells per-channel as one group of the whole row: group_size 37
    assert isinstance(loaded, RtnWeight) and loaded.group_size == 37
    for weight in (q, loaded):
        for start, stop in ((3, 20), (0, 1), (5, 37), (36, 37)):
            piece = weight.col_slice(start, stop)
            assert piece.group_size == weight.group_size and piece.scales.shape == (4, 1)
            assert torch.equal(piece.dequantize(), q.dequantize()[:, start:stop])
            assert torch.equal(round_trip(piece).dequantize(), q.dequantize()[:, start:stop])


@pytest.mark.parametrize("bad", [(-1, 3), (4, 3), (0, COLS + 1), (COLS + 1, COLS + 1), (True, 3), (0, 3.0)])
@pytest.mark.parametrize("fmt", ["lut", "lut8", "rtn"])
def test_ranges_outside_the_columns_are_a_contract_error(fmt: str, bad: tuple[object, object]) -> None:
    q: WeightFormat = (
        rtn(None, cols=COLS) if fmt == "rtn" else lut_weight(3, "int8" if fmt == "lut8" else "float16", True)
    )
    with pytest.raises(ValueError, match=f"in_features = {COLS}"):
        q.col_slice(*bad)  # type: ignore[arg-type]


def test_a_format_without_column_slices_says_which() -> None:
    q = ToyAbsmaxWeight.quantize(torch.randn(3, 8), None, WeightsConfig(bits=4))
    with pytest.raises(NotImplementedError, match="'toy-absmax'.*ToyAbsmaxWeight"):
        q.col_slice(0, 4)
