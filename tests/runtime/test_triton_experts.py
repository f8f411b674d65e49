"""The grouped Triton dequantization of routed experts, under TRITON_INTERPRET=1 on CPU tensors: bit-identical to
the reference dequantization of the selected experts' rows, for every code width, both LUT dtypes, with and
without a sparse part, and through SqueezeExperts when its kernel layout is prepared."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first defined (it is, lazily, on first launch)

import pytest
import torch

from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import RtnWeight
from squeeze.runtime.experts import SqueezeExperts
from squeeze.runtime.kernels import triton_available
from squeeze.runtime.kernels.triton_experts import dequantize_experts, prepare_experts

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
E, OUT, IN = 5, 20, 70  # rows and columns past one 16 x 64 block, a ragged last byte at 3 bits


@needs_triton
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
@pytest.mark.parametrize("outliers", [0.0, 0.03])
def test_grouped_kernel_equals_the_reference(bits: int, lut_dtype: str, outliers: float) -> None:
    torch.manual_seed(bits)
    q = quantize_lut(torch.randn(E * OUT, IN), None, bits, 0.0, outliers, lut_dtype=lut_dtype)
    assert (q.sparse is not None) == bool(outliers)
    prepared = prepare_experts(q, torch.device("cpu"))
    assert prepared is not None
    ids = torch.tensor([4, 0, 2])
    reference = q.dequantize(torch.float32).reshape(E, OUT, IN)[ids]
    assert torch.equal(dequantize_experts(prepared, q, ids, OUT, torch.float32), reference)
    half = q.dequantize(torch.float16).reshape(E, OUT, IN)[ids]
    assert torch.equal(dequantize_experts(prepared, q, ids, OUT, torch.float16), half)


@needs_triton
def test_no_experts_and_formats_without_the_lut_kernel() -> None:
    q = quantize_lut(torch.randn(E * OUT, IN), None, 4)
    prepared = prepare_experts(q, torch.device("cpu"))
    assert prepared is not None
    assert dequantize_experts(prepared, q, torch.empty(0, dtype=torch.int64), OUT, torch.float32).shape == (0, OUT, IN)

    class Options:
        bits, group_size, sensitive_fraction, outlier_fraction, lut_dtype = 4, None, 0.0, 0.0, "float16"

    rtn = RtnWeight.quantize(torch.randn(E * OUT, IN), None, Options())
    assert prepare_experts(rtn, torch.device("cpu")) is None  # RTN keeps the reference path


@needs_triton
@pytest.mark.parametrize("transposed", [False, True])
def test_squeeze_experts_through_the_kernel(transposed: bool) -> None:
    torch.manual_seed(0)
    q = quantize_lut(torch.randn(E * OUT, IN), None, 3, 0.0, 0.02)
    experts = SqueezeExperts(q, E, transposed=transposed)
    reference = experts.dequantize()
    experts._prepared = prepare_experts(q, torch.device("cpu"))  # what a move to CUDA prepares
    assert torch.equal(experts[torch.tensor([3, 1, 3])], reference[torch.tensor([3, 1, 3])])
    assert torch.equal(experts[torch.tensor(2)], reference[2])
