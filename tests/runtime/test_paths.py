"""weight_paths / describe_weight_paths: which path each quantized linear of a model runs, in one line."""

from __future__ import annotations

import torch
from torch import nn

from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize
from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.weight_paths import describe_weight_paths, weight_paths


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))  # (rows, cols) float32


def _lut_linear(seed: int, **kwargs: bool) -> SqueezeLinear:
    return SqueezeLinear(quantize_lut(_weight(8, 32, seed), None, 4), **kwargs)


def _rtn_linear(seed: int, **kwargs: bool) -> SqueezeLinear:
    return SqueezeLinear(rtn_quantize(_weight(8, 32, seed), 4, group_size=16), **kwargs)


def _native() -> str:
    """The path a LUT weight takes on this machine's CPU by default."""
    kernels = cpu_kernels()
    return f"native-{kernels.isa}" if kernels is not None else "dense"


def test_counts_follow_each_modules_path_in_first_seen_order() -> None:
    # RTN first: its path (no kernel covers RTN) must come first in the counts, whatever the LUT path is
    model = nn.Sequential(_rtn_linear(0), _lut_linear(1), nn.ReLU(), _lut_linear(2), nn.Linear(32, 8))
    counts = weight_paths(model)
    if _native() == "dense":  # no compiler here: every weight falls back to the dense path
        assert counts == {"dense": 3} and describe_weight_paths(counts) == "dense (3 linears)"
    else:
        assert list(counts.items()) == [("dense", 1), (_native(), 2)]
        assert describe_weight_paths(counts) == f"dense (1 linear), {_native()} (2 linears)"


def test_dense_cache_and_low_memory_are_counted_as_such() -> None:
    dense = nn.Sequential(_lut_linear(0, dense_cache=True), _rtn_linear(1, dense_cache=True))
    assert weight_paths(dense) == {"dense": 2}
    low = nn.Sequential(_lut_linear(0, low_memory=True), _rtn_linear(1, low_memory=True))
    expected = {_native(): 1, "chunked": 1} if _native() != "dense" else {"chunked": 2}
    assert weight_paths(low) == expected


def test_descriptions() -> None:
    assert describe_weight_paths({"native-avx512": 210}) == "native-avx512 (210 linears)"
    assert (
        describe_weight_paths({"native-avx512": 168, "dense": 42}) == "native-avx512 (168 linears), dense (42 linears)"
    )
    assert describe_weight_paths({"chunked": 1}) == "chunked (1 linear)"
    assert (
        describe_weight_paths({"native-avx2": 8, "native-avx2:experts": 4, "reference:experts": 1})
        == "native-avx2 (8 linears), native-avx2 (4 expert parameters), reference (1 expert parameter)"
    )
    assert describe_weight_paths({}) == "no quantized linears"
    assert describe_weight_paths(weight_paths(nn.Sequential(nn.Linear(4, 4)))) == "no quantized linears"


def test_without_native_kernels_lut_weights_count_as_dense(monkeypatch) -> None:
    import squeeze.runtime.linear as linear

    monkeypatch.setattr(linear, "prepare_cpu", lambda qweight, **_: None)  # what a machine without g++ gets
    model = nn.Sequential(_lut_linear(0), _lut_linear(1), _lut_linear(2, low_memory=True))
    assert describe_weight_paths(weight_paths(model)) == "dense (2 linears), chunked (1 linear)"


def test_expert_parameters_are_counted_apart_from_linears() -> None:
    from squeeze.runtime.experts import SqueezeExperts

    experts = SqueezeExperts(quantize_lut(_weight(4 * 8, 32, 3), None, 4), 4)  # 4 experts of 8 x 32
    model = nn.Sequential(_lut_linear(0), experts)
    assert weight_paths(model) == {_native(): 1, f"{experts.weight_path}:experts": 1}
    assert describe_weight_paths(weight_paths(model)).endswith(f"{experts.weight_path} (1 expert parameter)")
