"""Round-to-nearest baseline: error bound, fp16-consistent round trip, groups, constant rows."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import FormatError, ModelError
from squeeze.quant.schemes.lut import LutWeight
from squeeze.quant.schemes.rtn import RtnWeight, rtn_quantize


def layer(rows: int = 6, cols: int = 172, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02


def per_column(t: torch.Tensor, group_size: int | None, n: int) -> torch.Tensor:
    gs = group_size or n
    return t.float().repeat_interleave(gs, dim=1)[:, :n]


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])  # 6: embedding rows only (squeeze.limits.EMBEDDING_ONLY_BITS)
@pytest.mark.parametrize("group_size", [None, 64, 32, 172, 500])
def test_error_is_at_most_half_a_step(bits: int, group_size: int | None) -> None:
    w = layer()
    q = rtn_quantize(w, bits, group_size)
    G = 1 if group_size is None else -(-172 // group_size)  # 64 -> 3 groups, the last one partial (44)
    assert q.scales.shape == (6, G) and q.zeros.shape == (6, G)
    assert q.scales.dtype == torch.float16 and q.zeros.dtype == torch.float16
    z = q.zeros.float()
    assert torch.equal(z, z.round()) and (z >= 0).all() and (z <= 2**bits - 1).all()
    err = (q.dequantize() - w).abs()
    bound = per_column(q.scales, group_size, 172) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())


def test_dequantize_uses_the_stored_fp16_scales() -> None:
    w = layer()
    q = rtn_quantize(w, 4, 64)
    codes = q.codes().float()
    expected = (codes - per_column(q.zeros, 64, 172)) * per_column(q.scales, 64, 172)
    assert torch.equal(q.dequantize(), expected)
    assert q.dequantize(torch.float16).dtype == torch.float16


def test_constant_and_zero_rows() -> None:
    w = torch.zeros(4, 10)
    w[1] = 0.5
    w[2] = -0.25
    w[3, :5] = 3.0  # two groups of 5: one constant non-zero, one all zeros
    q = rtn_quantize(w, 3, 5)
    deq = q.dequantize()
    assert torch.equal(deq[0], torch.zeros(10))  # all-zero groups are exact (scale 1, zero 0)
    assert torch.equal(deq[3, 5:], torch.zeros(5))
    assert torch.isfinite(q.scales.float()).all() and (q.scales.float() > 0).all()
    err = (deq - w).abs()
    assert bool((err <= per_column(q.scales, 5, 10) / 2 * (1 + 1e-5)).all())


def test_storage_bits_and_tensor_round_trip() -> None:
    w = layer(4, 172)
    q = rtn_quantize(w, 3, 64)
    assert q.storage_bits() == 4 * 65 * 8 + 2 * (4 * 3 * 16)  # packed + fp16 scales + fp16 zeros
    tensors = q.to_tensors("model.layers.0.mlp.up_proj")
    assert sorted(tensors) == [
        "model.layers.0.mlp.up_proj.weight_packed",
        "model.layers.0.mlp.up_proj.weight_scales",
        "model.layers.0.mlp.up_proj.weight_zeros",
    ]
    back = RtnWeight.from_tensors(tensors, "model.layers.0.mlp.up_proj", bits=3, in_features=172, group_size=64)
    assert torch.equal(back.dequantize(), q.dequantize())


def test_six_bit_rows_round_trip_through_the_artifact_entry() -> None:
    w = layer(5, 576)
    q = rtn_quantize(w, 6)
    assert q.packed.shape == (5, 432)  # 4 codes in 3 bytes
    assert q.storage_bits() == 5 * 432 * 8 + 2 * 5 * 16  # 6.06 bits per weight at d = 576
    codes = q.codes()
    assert int(codes.max()) <= 63 and int(codes.max()) > 31  # the full 64-level grid is used
    back = RtnWeight.from_spec(q.to_tensors("m"), "m", q.module_spec())
    assert back.bits == 6 and torch.equal(back.dequantize(), q.dequantize())
    # a 6-bit entry is an RTN width only: the LUT format refuses it where an artifact is read
    with pytest.raises(FormatError, match=r"bits must be one of \[2, 3, 4, 8\], found 6"):
        LutWeight.from_tensors({}, "m", bits=6, in_features=576)
    with pytest.raises(FormatError, match=r"bits must be one of \[2, 3, 4, 6, 8\], found 5"):
        RtnWeight.from_spec(q.to_tensors("m"), "m", {**q.module_spec(), "bits": 5})


def test_from_tensors_rejects_bad_tensors() -> None:
    q = rtn_quantize(layer(4, 172), 4, 64)
    good = q.to_tensors("m")

    def load(**changes: torch.Tensor | None) -> RtnWeight:
        tensors = dict(good)
        for role, value in changes.items():
            if value is None:
                del tensors[f"m.{role}"]
            else:
                tensors[f"m.{role}"] = value
        return RtnWeight.from_tensors(tensors, "m", bits=4, in_features=172, group_size=64)

    with pytest.raises(FormatError, match="missing tensor m.weight_scales"):
        load(weight_scales=None)
    with pytest.raises(FormatError, match=r"m.weight_scales: expected torch.float16 \(4, 3\), found torch.float32"):
        load(weight_scales=q.scales.float())
    with pytest.raises(FormatError, match=r"m.weight_zeros: expected torch.float16 \(4, 3\), found .* \(4, 2\)"):
        load(weight_zeros=q.zeros[:, :2])
    with pytest.raises(FormatError, match="integers"):
        load(weight_zeros=q.zeros + 0.5)
    with pytest.raises(FormatError, match="m.weight_packed"):
        load(weight_packed=q.packed[:, :-1])
    with pytest.raises(FormatError, match="group_size"):
        RtnWeight.from_tensors(good, "m", bits=4, in_features=172, group_size=0)


def test_misuse_is_a_value_error_and_nan_weights_a_model_error() -> None:
    with pytest.raises(ValueError, match="bits"):
        rtn_quantize(layer(), 5)
    with pytest.raises(ValueError, match="group_size"):
        rtn_quantize(layer(), 4, 0)
    with pytest.raises(ValueError, match="2-D"):
        rtn_quantize(torch.zeros(3), 4)
    with pytest.raises(ModelError, match="NaN"):
        rtn_quantize(torch.tensor([[float("nan"), 1.0]]), 4)
