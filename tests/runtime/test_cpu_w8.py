"""The W4A8 CPU kernel (squeeze/runtime/kernels/cpu_w8.cpp, cpu_w8.py): bit for bit the torch reference
(w4a8_matmul_reference) on every instruction set this CPU runs, batch-invariant, and close to the exact
float32-LUT product."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from squeeze.errors import ConfigError
from squeeze.quant.schemes.lut import LutWeight, quantize_lut
from squeeze.runtime.activations import check_activations
from squeeze.runtime.kernels.cpu_build import ISAS, CpuKernels, cpu_kernels
from squeeze.runtime.kernels.cpu_lut import CpuPreparedLut, cpu_lut_linear, prepare_cpu
from squeeze.runtime.kernels.reference import (
    W8_GROUP,
    lut_matmul_reference,
    quantize_groups_int8,
    w4a8_matmul_reference,
)
from squeeze.runtime.linear import SqueezeLinear, drafting

ROWS = 37  # not a multiple of the 4-row panels nor of the 16-row tasks
BATCHES = (1, 2, 7, 8, 9, 16, 33, 200)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    found = cpu_kernels()
    if found is None:
        pytest.skip("no working C++ compiler: the native CPU kernels are unavailable")
    return found


@functools.cache
def lut_weight(bits: int, n: int, sparse: bool, lut_dtype: str) -> LutWeight:
    g = torch.Generator().manual_seed(100 * bits + n)
    w = torch.randn(ROWS, n, generator=g)
    stored = "float16" if lut_dtype == "float32" else lut_dtype
    if sparse:
        q = quantize_lut(w, w.abs() + 0.1, bits, 0.01, 0.02, lut_dtype=stored)
        assert q.sparse is not None and q.sparse.nnz > 0
    else:
        q = quantize_lut(w, None, bits, lut_dtype=stored)
    if lut_dtype == "float32":  # a float32 LUT (weights built so): the kernels read it in place too
        q = dataclasses.replace(q, lut=q.lut.float())
    return q


def prepared_for(kernels: CpuKernels, isa: str, q: LutWeight) -> CpuPreparedLut:
    if not kernels.supports(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    prepared = prepare_cpu(q, kernels=kernels.with_isa(isa), activations="int8")
    assert prepared is not None and prepared.activations == "int8"
    return prepared


# 172: one chunk and a 44-column tail; 576 = 4.5 chunks; 577 and 33: odd tails; 128: whole chunks only
CASES = [
    (bits, n, sparse, lut_dtype)
    for bits in (4, 3)
    for n in (33, 128, 172, 576, 577)
    for sparse in (False, True)
    for lut_dtype in ("float16", "float32", "int8")
]


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize(("bits", "n", "sparse", "lut_dtype"), CASES)
def test_kernel_is_the_reference_bit_for_bit(
    kernels: CpuKernels, isa: str, bits: int, n: int, sparse: bool, lut_dtype: str
) -> None:
    q = lut_weight(bits, n, sparse, lut_dtype)
    prepared = prepared_for(kernels, isa, q)
    g = torch.Generator().manual_seed(n)
    bias = torch.randn(ROWS, generator=g)
    for batch in BATCHES:
        x = torch.randn(batch, n, generator=g) * torch.rand(batch, 1, generator=g) * 10
        for b in (bias, None):
            got = cpu_lut_linear(x, prepared, b)
            assert torch.equal(got, w4a8_matmul_reference(x, q, b)), (batch, b is None)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize(("bits", "n"), [(4, 576), (3, 577)])
def test_a_row_gets_the_same_bits_in_any_batch(kernels: CpuKernels, isa: str, bits: int, n: int) -> None:
    q = lut_weight(bits, n, True, "float16")
    prepared = prepared_for(kernels, isa, q)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, n, generator=g)
    alone = torch.cat([cpu_lut_linear(x[i : i + 1], prepared) for i in range(40)])
    for batch in (2, 3, 5, 8, 9, 16, 33, 200):
        together = cpu_lut_linear(x[:batch], prepared)
        assert torch.equal(together[: min(batch, 40)], alone[: min(batch, 40)]), batch
    shuffled = torch.randperm(40, generator=g)
    assert torch.equal(cpu_lut_linear(x[shuffled], prepared), alone[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_lut_linear(x[:40], prepared), alone)
    finally:
        torch.set_num_threads(threads)


def test_every_instruction_set_gives_the_same_bits(kernels: CpuKernels) -> None:
    q = lut_weight(4, 576, True, "int8")
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3))
    prepared = [prepare_cpu(q, kernels.with_isa(isa), "int8") for isa in ISAS if kernels.supports(isa)]
    results = [cpu_lut_linear(x, p) for p in prepared if p is not None]
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("bits", [4, 3])
def test_int8_activations_stay_close_to_the_exact_product(kernels: CpuKernels, bits: int) -> None:
    """int8 activations per group of 64 columns (rounding error <= the group's amax / 254 per element) and int8
    LUT levels: against the float32-LUT product the relative L2 error stays under 1% on Gaussian activations
    (measured 0.70%; per-row scales gave 0.83%) and under 2.5% with one channel 50x the others (1.7%; per-row
    scales: 5.0%, every column of the row paid for the outlier)."""
    q = lut_weight(bits, 576, True, "float16")
    prepared = prepare_cpu(q, kernels=kernels, activations="int8")
    assert prepared is not None
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(5))
    got, exact = cpu_lut_linear(x, prepared), lut_matmul_reference(x, q)
    assert float((got - exact).norm() / exact.norm()) < 0.01
    x[:, 3] *= 50  # an outlier channel, as LLM activations have
    got, exact = cpu_lut_linear(x, prepared), lut_matmul_reference(x, q)
    assert float((got - exact).norm() / exact.norm()) < 0.025


def test_activation_groups_are_64_columns_each_with_its_own_scale() -> None:
    x = torch.zeros(1, 130)  # groups: columns 0-63, 64-127, 128-129
    x[0, [0, 64, 65, 128, 129]] = torch.tensor([127.0, 1.0, -0.5, 2.0, 1.0])
    q, sx = quantize_groups_int8(x)
    expected = torch.tensor([[1.0, 1.0 / 127.0, 2.0 / 127.0]], dtype=torch.float32)  # amax / 127, in float32
    assert sx.dtype == torch.float32 and torch.equal(sx, expected)
    assert q[0, [0, 64, 65, 128, 129]].tolist() == [127.0, 127.0, -64.0, 127.0, 64.0]  # -63.5, 63.5: half to even
    assert int(q.count_nonzero()) == 5
    assert W8_GROUP == 64


def test_zero_rows_and_empty_inputs(kernels: CpuKernels) -> None:
    q = lut_weight(4, 172, True, "float16")
    prepared = prepare_cpu(q, kernels=kernels, activations="int8")
    assert prepared is not None
    bias = torch.randn(ROWS)
    x = torch.zeros(3, 172)
    x[1] = torch.randn(172)
    got = cpu_lut_linear(x, prepared, bias)
    assert torch.equal(got, w4a8_matmul_reference(x, q, bias))
    assert torch.equal(got[0], bias) and torch.equal(got[2], bias)
    assert cpu_lut_linear(torch.randn(0, 172), prepared, bias).shape == (0, ROWS)


def test_other_widths_and_float32_keep_the_float32_kernels(kernels: CpuKernels) -> None:
    w = torch.randn(16, 64)
    assert prepare_cpu(quantize_lut(w, None, 2), kernels=kernels, activations="int8").activations == "float32"  # type: ignore[union-attr]
    assert prepare_cpu(lut_weight(4, 172, False, "float16"), kernels=kernels, activations="float32").w8 is None  # type: ignore[union-attr]


def test_squeeze_linear_takes_the_activations_option(kernels: CpuKernels) -> None:
    q = lut_weight(4, 576, False, "float16")
    x = torch.randn(5, 576)
    with torch.inference_mode():
        fast = SqueezeLinear(q, activations="int8")(x)
        exact = SqueezeLinear(q)(x)  # the default: float32
    assert torch.equal(fast, w4a8_matmul_reference(x, q))
    assert torch.allclose(exact.double(), lut_matmul_reference(x.double(), q).double(), atol=1e-4)


def test_the_draft_form_runs_the_int8_kernel_over_the_modules_own_codes(kernels: CpuKernels) -> None:
    """SqueezeLinear.prepare_draft (speculative decoding's int8 drafter): inside drafting() a float32 module runs
    the W4A8 form, bit for bit the reference, reading the packed codes of its buffer (no copy); outside it runs
    float32 as before. Idempotent; a 2-bit weight has no draft form."""
    q = lut_weight(4, 576, True, "float16")
    module = SqueezeLinear(q)  # the default activations: float32
    extra = module.prepare_draft()
    assert extra > 0 and module.prepare_draft() == extra
    prepared, draft = module._cpu, module._draft
    assert prepared is not None and draft is not None and draft.w8 is not None and prepared.w8 is None
    assert prepared.packed is prepared.keep[0] and torch.equal(prepared.packed, q.packed)
    own = {t.data_ptr() for t in module.buffers()}
    assert prepared.packed.data_ptr() in own and draft.w8.weight.packed == prepared.packed.data_ptr()
    x = torch.randn(5, 576)
    with torch.inference_mode():
        with drafting():
            drafted = module(x)
        exact = module(x)
    assert torch.equal(drafted, w4a8_matmul_reference(x, q)) and not torch.equal(drafted, exact)
    assert torch.equal(exact, SqueezeLinear(q)(x))
    assert SqueezeLinear(quantize_lut(torch.randn(16, 64), None, 2)).prepare_draft() == 0


@pytest.mark.parametrize("bad", ["bf16", "INT8", None, 8])
def test_the_option_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match="activations must be one of 'int8', 'float32'"):
        check_activations(bad)
