"""The weight-format registry: lookups, the generic checks, exact byte estimates, row slices, a toy format."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from squeeze.config import WeightsConfig
from squeeze.errors import FormatError
from squeeze.quant import schemes
from squeeze.quant.schemes import Lut8Weight, LutWeight, RtnWeight
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.loader import quantized_weight_from
from toy_format import ToyAbsmaxWeight


def weight(rows: int = 6, cols: int = 172, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02, torch.rand(rows, cols, generator=g)


CASES = {
    "lut": WeightsConfig(bits=3),
    "lut-sparse": WeightsConfig(bits=4, sensitive_fraction=0.005, outlier_fraction=0.01),
    "lut8-sparse": WeightsConfig(bits=3, lut_dtype="int8", outlier_fraction=0.02),
    "rtn": WeightsConfig(method="rtn", bits=4),
    "rtn-g64": WeightsConfig(method="rtn", bits=3, group_size=64),
}


def test_built_in_formats_and_their_methods() -> None:
    assert [cls.name for cls in schemes.formats()] == ["lut", "lut8", "rtn"]
    assert schemes.methods() == ("squeeze", "rtn")
    assert set(schemes.stored_roles()) == {
        "weight_packed",
        "weight_lut",
        "weight_lut_scale",
        "weight_lut_zero",
        "weight_scales",
        "weight_zeros",
        "weight_sparse_rowptr",
        "weight_sparse_cols",
        "weight_sparse_vals",
    }


def test_a_recipe_selects_its_format() -> None:
    assert schemes.format_for_recipe(WeightsConfig()) is LutWeight
    assert schemes.format_for_recipe(WeightsConfig(lut_dtype="int8")) is Lut8Weight
    assert schemes.format_for_recipe(WeightsConfig(method="rtn")) is RtnWeight


def test_an_artifact_entry_selects_its_format_by_method_and_role_dtypes() -> None:
    assert (
        schemes.format_for_module("squeeze", {"weight_packed": torch.uint8, "weight_lut": torch.float16}) is LutWeight
    )
    lut8 = {"weight_packed": torch.uint8, "weight_lut": torch.uint8, "weight_lut_scale": torch.float16}
    assert schemes.format_for_module("squeeze", lut8) is Lut8Weight  # its zero is missing: its checks say so
    assert schemes.format_for_module("rtn", {}) is RtnWeight
    assert schemes.format_for_module("gptq", {}) is None
    assert schemes.format_for_module(["squeeze"], {}) is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_byte_estimate_is_exact_and_the_module_entry_is_the_weight_written(case: str) -> None:
    options = CASES[case]
    w, f = weight()
    cls = schemes.format_for_recipe(options)
    q = cls.quantize(w, f, options)
    assert type(q) is cls
    assert cls.estimate_bytes(6, 172, options, value_bytes=4) * 8 == q.storage_bits()
    spec = q.module_spec()
    assert spec["method"] == options.method and (spec["bits"], spec["in_features"], spec["out_features"]) == (
        options.bits,
        172,
        6,
    )
    if cls is RtnWeight:
        assert spec["group_size"] == (options.group_size or 172)  # per channel: one group of the whole row
    else:
        assert set(spec) == {"method", "bits", "in_features", "out_features"}
    again = quantized_weight_from(q.to_tensors("m"), "m", spec)
    assert type(again) is cls and torch.equal(again.dequantize(), q.dequantize())


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_slices_dequantize_bit_identically(case: str) -> None:
    options = CASES[case]
    w, f = weight(9, 40, seed=1)
    q = schemes.format_for_recipe(options).quantize(w, f, options)
    dense = q.dequantize(torch.bfloat16)
    module = SqueezeLinear(q)
    for start, stop in ((0, 9), (0, 1), (3, 7), (8, 9), (4, 4)):
        assert torch.equal(q.row_slice(start, stop).dequantize(torch.bfloat16), dense[start:stop])
        assert torch.equal(module.dequantize_rows(start, stop, torch.bfloat16), dense[start:stop])
    module.chunk_rows = 4  # the chunked forward (low_memory=True where no kernel covers the format) over 3 slices
    x = torch.randn(2, 40)
    assert torch.allclose(module.chunked_forward(x), x @ q.dequantize().T, atol=1e-6)
    assert torch.allclose(module(x), x @ q.dequantize().T, atol=1e-5)  # the default path (native for LUT formats)


def test_meta_tensors_are_checked_for_shapes_only() -> None:
    w, f = weight()
    q = LutWeight.quantize(w, f, CASES["lut-sparse"])
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in q.to_tensors("m").items()}
    rebuilt = quantized_weight_from(meta, "m", q.module_spec(), check_values=False)
    assert type(rebuilt) is LutWeight and rebuilt.packed.is_meta
    meta["m.weight_lut"] = torch.empty(5, 16, dtype=torch.float16, device="meta")
    with pytest.raises(
        FormatError, match=r"m.weight_lut: expected torch.float16 \(6, 16\), found torch.float16 \(5, 16\)"
    ):
        quantized_weight_from(meta, "m", q.module_spec(), check_values=False)


def test_unknown_method_in_an_artifact_names_the_known_ones() -> None:
    with pytest.raises(FormatError, match="unknown method 'gptq'") as info:
        quantized_weight_from({}, "m", {"method": "gptq", "bits": 4, "in_features": 8})
    assert "'squeeze'" in info.value.hint and "'rtn'" in info.value.hint


def test_registering_a_second_class_under_a_taken_name_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Impostor(ToyAbsmaxWeight):
        name = "lut"

    with pytest.raises(ValueError, match="already registered"):
        schemes.register_format(Impostor)
    schemes.register_format(LutWeight)  # the same class again is a no-op


def test_a_toy_format_is_one_class(toy_registered: type[ToyAbsmaxWeight]) -> None:
    options = WeightsConfig(method="toy", bits=8)  # recipes accept it once registered
    assert schemes.format_for_recipe(options) is toy_registered
    w, _ = weight()
    q = toy_registered.quantize(w, None, options)
    assert toy_registered.estimate_bytes(6, 172, options, 4) * 8 == q.storage_bits() == 6 * 172 * 8 + 6 * 16
    again = quantized_weight_from(q.to_tensors("m"), "m", q.module_spec())
    assert torch.equal(again.dequantize(), q.dequantize())
    assert (again.dequantize() - w).abs().max() <= q.row_scale.float().max() / 2 + 1e-7
    bad = q.to_tensors("m") | {"m.weight_row_scale": torch.full((6, 1), float("nan"), dtype=torch.float16)}
    with pytest.raises(FormatError, match="weight_row_scale must be finite"):
        quantized_weight_from(bad, "m", q.module_spec())


def test_a_method_is_unknown_to_recipes_until_registered() -> None:
    from squeeze.errors import ConfigError

    with pytest.raises(ConfigError, match="weights.method must be one of"):
        WeightsConfig(method="toy")
