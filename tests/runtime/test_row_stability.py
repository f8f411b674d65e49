"""Rows whose bits do not depend on their batch: the dense float32 kernel (the LM head) and the LUT kernels' row
plan, which squeeze serve relies on to give each request the text squeeze run gives it alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.dense_linear import RowStableLinear, stabilise_dense_linears
from squeeze.runtime.kernels.cpu_build import ISAS, CpuKernels, cpu_kernels
from squeeze.runtime.kernels.cpu_dense import cpu_dense_linear
from squeeze.runtime.kernels.cpu_lut import GEMV_MAX_ROWS, RowPlan, cpu_lut_linear, prepare_cpu, row_paths


@pytest.fixture()
def kernels() -> CpuKernels:
    found = cpu_kernels()
    if found is None:
        pytest.skip("no working C++ compiler: the native CPU kernels are unavailable")
    return found


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("n", [7, 64, 576, 1000])  # lane tails of 16 and 8, and none
def test_dense_kernel_rows_do_not_depend_on_the_batch(kernels: CpuKernels, isa: str, n: int) -> None:
    if not kernels.supports(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    k = kernels.with_isa(isa)
    g = torch.Generator().manual_seed(n)
    weight, bias, x = torch.randn(300, n, generator=g), torch.randn(300, generator=g), torch.randn(21, n, generator=g)
    alone = [cpu_dense_linear(x[i : i + 1], weight, bias, k) for i in range(21)]
    for batch in (2, 8, 9, 21):
        together = cpu_dense_linear(x[:batch], weight, bias, k)
        for i in range(batch):
            assert torch.equal(together[i : i + 1], alone[i]), (batch, i)
    expected = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(torch.cat(alone).double(), expected, atol=1e-4, rtol=1e-5)


def test_row_stable_linear_is_an_nn_linear_that_keeps_its_parameters(kernels: CpuKernels) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    tied = model[2].weight
    assert stabilise_dense_linears(model) == 2
    assert all(isinstance(m, RowStableLinear) for m in (model[0], model[2])) and model[2].weight is tied
    x = torch.randn(5, 16)
    with torch.inference_mode():
        rows = torch.cat([model(x[i : i + 1]) for i in range(5)])
        assert torch.equal(model(x), rows)
        assert torch.allclose(model(x), F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), tied), atol=1e-5)
    x.requires_grad_(True)
    model(x).sum().backward()  # with gradients the module is plain F.linear
    assert x.grad is not None


def test_the_row_plan_gives_each_row_the_bits_of_its_own_path(kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 576, generator=g)
    prepared = prepare_cpu(quantize_lut(w, w.abs() + 0.1, 4, 0.01, 0.02), kernels=kernels, activations="float32")
    assert prepared is not None
    bias = torch.randn(96, generator=g)
    prompt = torch.randn(40, 576, generator=g)  # a prompt longer than GEMV_MAX_ROWS: squeeze run's tile path
    decode = torch.randn(5, 576, generator=g)  # one token each: the GEMV
    assert prompt.shape[0] > GEMV_MAX_ROWS
    prefill_alone = cpu_lut_linear(prompt, prepared, bias)
    decode_alone = [cpu_lut_linear(decode[i : i + 1], prepared, bias) for i in range(5)]
    # a packed step: 3 decode rows, the prompt's last 7 tokens (a chunk), 2 more decode rows
    x = torch.cat([decode[:3], prompt[33:], decode[3:]])
    tiled = torch.arange(3, 10)
    plan = RowPlan(12, tiled, torch.tensor([0, 1, 2, 10, 11]))
    with row_paths(plan):
        y = cpu_lut_linear(x, prepared, bias)
    assert torch.equal(y[3:10], prefill_alone[33:])  # 7 rows padded to 16 for the GEMM: the same bits
    for row, i in zip((0, 1, 2, 10, 11), range(5), strict=True):
        assert torch.equal(y[row : row + 1], decode_alone[i])
    without_plan = cpu_lut_linear(x, prepared, bias)  # 12 rows: all GEMV, so the chunk's bits differ
    assert not torch.equal(without_plan[3:10], prefill_alone[33:])
