"""Rows whose bits do not depend on their batch: the dense float32 kernel (the LM head) and the LUT kernels' one
matmul, which squeeze serve relies on to give each request the text squeeze run gives it alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.dense_linear import RowStableLinear, stabilise_dense_linears
from squeeze.runtime.kernels.cpu_build import ISAS, CpuKernels, cpu_kernels
from squeeze.runtime.kernels.cpu_dense import cpu_dense_linear
from squeeze.runtime.kernels.cpu_lut import cpu_lut_linear, prepare_cpu


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


#: the batch sizes a row is compared at: the fused AVX-512 form (up to 4 rows of x), a partial block of x rows
#: (3, 17), whole ones, panels with many blocks (100)
BATCHES = (2, 3, 8, 16, 17, 32, 100)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("activations", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(
    ("bits", "n", "sparse"),
    [(4, 172, True), (4, 576, False), (3, 172, True), (3, 200, False), (3, 576, True), (2, 33, True)],
)
def test_lut_rows_do_not_depend_on_the_batch(
    kernels: CpuKernels, isa: str, activations: str, bits: int, n: int, sparse: bool
) -> None:
    """Every form (float32, bfloat16 where AVX-512 BF16 runs it, int8) on every instruction set: a row of x gets
    the same bits alone and in batches of 2 .. 100 (37
    output rows: not a multiple of a 4-row group or a panel; odd N; 3 and 4 bits with and without a sparse
    part; 2 bits: the scalar layout, and no int8 form, so the float32 kernels there too)."""
    if not kernels.supports(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    g = torch.Generator().manual_seed(7 * n + bits)
    w = torch.randn(37, n, generator=g)
    q = quantize_lut(w, w.abs() + 0.1, bits, 0.01, 0.02) if sparse else quantize_lut(w, None, bits)
    assert (q.sparse is not None and q.sparse.nnz > 0) == sparse
    prepared = prepare_cpu(q, kernels=kernels.with_isa(isa), activations=activations)  # type: ignore[arg-type]
    assert prepared is not None
    bf16 = isa == "avx512" and bool(kernels.lib.sq_bf16_supported())
    forms = {"int8": "int8" if bits in (3, 4) else "float32", "bfloat16": "bfloat16" if bf16 else "float32"}
    assert prepared.activations == forms.get(activations, "float32")
    bias = torch.randn(37, generator=g)
    x = torch.randn(max(BATCHES), n, generator=g)
    x[5] = 0.0  # an all-zero row (the int8 form's zero scale)
    alone = torch.cat([cpu_lut_linear(x[i : i + 1], prepared, bias) for i in range(x.shape[0])])
    for batch in BATCHES:
        assert torch.equal(cpu_lut_linear(x[:batch], prepared, bias), alone[:batch]), batch
    assert torch.equal(cpu_lut_linear(x[40:57], prepared, bias), alone[40:57])  # rows in other places of a batch
