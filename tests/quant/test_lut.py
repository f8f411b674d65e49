"""SqueezeLLM LUT quantization and the LutWeight container (tensors in/out, exact storage count)."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import ConfigError, FormatError
from squeeze.quant.schemes import Lut8Weight, LutWeight
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize

PREFIX = "model.layers.0.mlp.down_proj"


def layer(rows: int = 4, cols: int = 172, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02, torch.randn(rows, cols, generator=g) ** 2


def sqnr_db(w: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(w.double().pow(2).sum() / (w.double() - approx.double()).pow(2).sum()))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_lut_shapes_dtypes_and_nearest_codes(bits: int) -> None:
    w, f = layer()
    q = quantize_lut(w, f, bits)
    assert q.bits == bits and q.in_features == 172 and q.out_features == 4 and q.sparse is None
    assert q.lut.dtype == torch.float16 and q.lut.shape == (4, 2**bits)
    assert (q.lut[:, 1:] >= q.lut[:, :-1]).all()
    codes = q.codes().long()
    d = (w.double()[:, :, None] - q.lut.double()[:, None, :]).abs()
    assert torch.equal(d.gather(2, codes[:, :, None]).squeeze(2), d.min(2).values)  # nearest fp16 entry
    assert torch.equal(q.dequantize(), q.lut.float().gather(1, codes))


@pytest.mark.parametrize("sparse", [False, True])
def test_tensors_round_trip_is_bit_exact(sparse: bool) -> None:
    w, f = layer(6, 172)
    q = quantize_lut(w, f, 3, *((0.005, 0.01) if sparse else (0.0, 0.0)))
    tensors = q.to_tensors(PREFIX)
    names = {f"{PREFIX}.weight_packed", f"{PREFIX}.weight_lut"}
    if sparse:
        names |= {f"{PREFIX}.weight_sparse_rowptr", f"{PREFIX}.weight_sparse_cols", f"{PREFIX}.weight_sparse_vals"}
    assert set(tensors) == names
    back = LutWeight.from_tensors(tensors, PREFIX, bits=3, in_features=172)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert (back.sparse is not None) == sparse
    assert back.storage_bits() == q.storage_bits()


def test_storage_bits_hand_count() -> None:
    w, f = layer(4, 172)
    q = quantize_lut(w, f, 3, 0.005, 0.01)
    nnz = round(0.005 * 688) + round(0.01 * 688)  # 3 + 7
    assert q.sparse is not None and q.sparse.nnz == nnz
    packed = 4 * 65 * 8  # ceil(172 * 3 / 8) = 65 bytes per row
    lut = 4 * 8 * 16  # 2**3 fp16 entries per row
    sparse = 5 * 32 + nnz * 16 + nnz * 32  # int32 rowptr (R+1), int16 cols, fp32 vals
    assert q.storage_bits() == packed + lut + sparse
    assert quantize_lut(w, f, 3).storage_bits() == packed + lut


def test_sparse_positions_have_zero_kmeans_weight() -> None:
    """An outlier moved to the sparse part must not drag a centroid toward itself."""
    w, f = layer(2, 172)
    w[0, 5] = 1.0  # 50x the typical magnitude
    with_split = quantize_lut(w, f, 3, 0.0, 1 / 344)  # exactly one outlier: w[0, 5]
    assert with_split.sparse is not None and with_split.sparse.nnz == 1
    assert float(with_split.lut[0].float().abs().max()) < 0.2  # no centroid serves the outlier
    assert with_split.dequantize()[0, 5].item() == 1.0


def test_fisher_weighting_lowers_the_fisher_weighted_error(stories_tensors) -> None:
    w = stories_tensors["model.layers.0.mlp.down_proj.weight"].float()
    g = torch.Generator().manual_seed(0)
    f = torch.randn(w.shape, generator=g) ** 2
    for bits in (3, 4):
        weighted = (f * (quantize_lut(w, f, bits).dequantize() - w) ** 2).sum()
        uniform = (f * (quantize_lut(w, None, bits).dequantize() - w) ** 2).sum()
        assert weighted < 0.9 * uniform  # measured: 0.76x (3-bit), 0.66x (4-bit)


def test_sqnr_on_a_real_layer(stories_tensors) -> None:
    w = stories_tensors["model.layers.0.mlp.down_proj.weight"].float()  # (64, 172)
    lut4 = sqnr_db(w, quantize_lut(w, None, 4).dequantize())
    rtn4 = sqnr_db(w, rtn_quantize(w, 4).dequantize())
    assert lut4 > 20.0  # measured 22.5 dB
    assert lut4 > rtn4 + 2.0  # measured +3.1 dB over per-channel RTN
    assert sqnr_db(w, quantize_lut(w, None, 3).dequantize()) > 13.0  # measured 15.5 dB


def test_half_precision_weights() -> None:
    w, f = layer()
    q = quantize_lut(w.to(torch.bfloat16), f.to(torch.bfloat16), 4, 0.01, 0.01)
    assert q.sparse is not None and q.sparse.vals.dtype == torch.bfloat16
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_misuse_is_a_value_error_not_a_usage_error() -> None:
    # squeeze's own code passing the wrong thing is a bug (exit 3), not the user's fault (ConfigError, exit 2)
    w, f = layer()
    for call, match in (
        (lambda: quantize_lut(w, f, 5), "bits"),
        (lambda: quantize_lut(w, f[:, :10], 4), "fisher"),
        (lambda: quantize_lut(w[0], None, 4), "2-D"),
        (lambda: quantize_lut(w[None], None, 4), "2-D"),  # a 3-D tensor
        (lambda: quantize_lut(w, -f, 4), "nonnegative"),
    ):
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert not isinstance(info.value, ConfigError)


# ------------------------------------------------------------------------------------------------------
# LutWeight.from_tensors validation: each error names the tensor, what was expected and what was found


@pytest.fixture
def good_tensors() -> dict[str, torch.Tensor]:
    w, f = layer(4, 172)
    return quantize_lut(w, f, 3, 0.005, 0.01).to_tensors("m")


def load(tensors: dict[str, torch.Tensor], **changes: torch.Tensor | None) -> LutWeight:
    tensors = dict(tensors)
    for role, value in changes.items():
        if value is None:
            del tensors[f"m.{role}"]
        else:
            tensors[f"m.{role}"] = value
    return LutWeight.from_tensors(tensors, "m", bits=3, in_features=172)


def test_from_tensors_missing(good_tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(FormatError, match="missing tensor m.weight_packed"):
        load(good_tensors, weight_packed=None)
    with pytest.raises(FormatError, match="missing tensor m.weight_lut"):
        load(good_tensors, weight_lut=None)
    with pytest.raises(FormatError, match="incomplete sparse part: missing tensor.s. m.weight_sparse_cols"):
        load(good_tensors, weight_sparse_cols=None)


def test_from_tensors_wrong_dtypes_and_shapes(good_tensors: dict[str, torch.Tensor]) -> None:
    lut, packed = good_tensors["m.weight_lut"], good_tensors["m.weight_packed"]
    expected = r"m.weight_lut: expected torch.float16 \(4, 8\), found "
    with pytest.raises(FormatError, match=expected + r"torch.float32 \(4, 8\)"):
        load(good_tensors, weight_lut=lut.float())
    with pytest.raises(FormatError, match=expected + r"torch.float16 \(4, 16\)"):
        load(good_tensors, weight_lut=torch.cat([lut, lut], 1))
    with pytest.raises(FormatError, match=expected + r"torch.float16 \(3, 8\)"):
        load(good_tensors, weight_lut=lut[:3])
    with pytest.raises(
        FormatError, match=r"m.weight_packed: expected torch.uint8 \(4, 65\), found torch.uint8 \(4, 64\)"
    ):
        load(good_tensors, weight_packed=packed[:, :64])
    with pytest.raises(FormatError, match=r"m.weight_packed.*found torch.int16"):
        load(good_tensors, weight_packed=packed.to(torch.int16))
    with pytest.raises(FormatError, match=r"m.weight_sparse_rowptr: expected torch.int32 \(5,\), found torch.int64"):
        load(good_tensors, weight_sparse_rowptr=good_tensors["m.weight_sparse_rowptr"].long())
    with pytest.raises(FormatError, match=r"m.weight_sparse_cols: expected torch.int16"):
        load(good_tensors, weight_sparse_cols=good_tensors["m.weight_sparse_cols"].int())
    with pytest.raises(FormatError, match=r"m.weight_sparse_vals"):
        load(good_tensors, weight_sparse_vals=good_tensors["m.weight_sparse_vals"][:-1])


def test_from_tensors_malformed_sparse(good_tensors: dict[str, torch.Tensor]) -> None:
    cols = good_tensors["m.weight_sparse_cols"].clone()
    cols[0] = 172
    with pytest.raises(FormatError, match=r"m: sparse cols must be in \[0, 172\)"):
        load(good_tensors, weight_sparse_cols=cols)
    rowptr = good_tensors["m.weight_sparse_rowptr"].clone()
    rowptr[1] = int(rowptr[-1]) + 1  # beyond the next entries
    with pytest.raises(FormatError, match="m: sparse rowptr must be non-decreasing"):
        load(good_tensors, weight_sparse_rowptr=rowptr)


def test_from_tensors_bad_metadata(good_tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(FormatError, match="bits"):
        LutWeight.from_tensors(good_tensors, "m", bits=5, in_features=172)
    with pytest.raises(FormatError, match="in_features"):
        LutWeight.from_tensors(good_tensors, "m", bits=3, in_features=-1)


def test_precomputed_mask_gives_the_same_result_and_bad_masks_are_refused():
    from squeeze.quant.sparse import select_sparse

    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 40, generator=g)
    f = torch.rand(8, 40, generator=g)
    mask = select_sparse(w, f, 0.01, 0.02)
    direct = quantize_lut(w, f, 3, 0.01, 0.02)
    given = quantize_lut(w, f, 3, mask=mask)
    assert torch.equal(direct.dequantize(), given.dequantize())
    assert torch.equal(direct.packed, given.packed)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        quantize_lut(w, f, 3, mask=mask[:, :5])
    with pytest.raises(ValueError, match="either the sparse fractions or a precomputed mask"):
        quantize_lut(w, f, 3, 0.01, 0.02, mask=mask)  # the fractions would be silently ignored


def test_int8_lut_round_trips_exactly_and_costs_half_the_lut_bits():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 172, generator=g)
    f = torch.rand(4, 172, generator=g)
    q16 = quantize_lut(w, f, 3)
    q8 = quantize_lut(w, f, 3, lut_dtype="int8")
    assert q8.lut.dtype == torch.uint8 and q8.lut_scale.shape == (4, 1) and q8.lut_zero.dtype == torch.float16
    # exact count: codes 4 rows x 65 bytes; LUT 4 x 8 levels x 8 bits + fp16 scale and zero per row
    assert q8.storage_bits() == 4 * 65 * 8 + 4 * 8 * 8 + 4 * 2 * 16
    assert q16.storage_bits() - q8.storage_bits() == 4 * 8 * 8 - 4 * 2 * 16
    assert type(q8) is Lut8Weight and type(q16) is LutWeight
    again = Lut8Weight.from_tensors(q8.to_tensors("m"), "m", bits=3, in_features=172)
    assert torch.equal(again.dequantize(), q8.dequantize())
    # every dense value is a stored grid value, and the codes pick the nearest one
    values = q8.lut_values()
    dense = q8.dequantize()
    assert torch.equal(dense, values.gather(1, q8.codes().long()))
    nearest = (w[:, :, None] - values[:, None, :]).abs().argmin(-1)
    assert torch.equal(values.gather(1, nearest), dense)
    # the 8-bit grid costs little accuracy against the float16 LUT (Fisher-weighted error)
    err16 = ((q16.dequantize() - w) ** 2 * f).sum()
    err8 = ((dense - w) ** 2 * f).sum()
    assert err8 <= err16 * 1.05
    tensors = q8.to_tensors("m")
    del tensors["m.weight_lut_scale"]
    with pytest.raises(FormatError, match="missing tensor m.weight_lut_scale"):
        Lut8Weight.from_tensors(tensors, "m", bits=3, in_features=172)


def test_unknown_lut_dtype_is_refused():
    with pytest.raises(ValueError, match="lut_dtype"):
        quantize_lut(torch.randn(2, 8), None, 3, lut_dtype="fp8")
