"""The native CPU LUT kernels (squeeze/runtime/kernels/cpu_lut.cpp, cpu_lut.py, cpu_build.py).

Differential against the format's reference ``qweight.dequantize(torch.float32)``: every instruction set this
CPU runs, every code width, row lengths that hit each part of the layout (whole blocks, the 3-bit half
block, the scalar tail), with and without the sparse part, fp16 and 8-bit LUTs, the one matmul at every row
count. Golden values for the kernels' column order, the build cache, the fallbacks without a
compiler, and SqueezeLinear's choice of path.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes import WeightFormat
from squeeze.quant.schemes.lut import Lut8Weight, LutWeight, quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize
from squeeze.runtime.kernels.cpu_build import ISAS, CpuKernels, KernelWarning, cpu_kernels
from squeeze.runtime.kernels.cpu_lut import cpu_lut_linear, permuted_positions, prepare_cpu
from squeeze.runtime.kernels.reference import dense_lut_values, sparse_residual
from squeeze.runtime.linear import SqueezeLinear

ROWS = 41  # output rows: not a multiple of the kernels' 4-row groups or 32-row panels
IN_FEATURES = (1, 7, 33, 172, 200, 576, 1536)  # 200 at 3 bits: a 128-column block, a 64-column half block, 8 more
BITS = (2, 3, 4, 8)
LUT_DTYPES = ("float16", "int8")


@pytest.fixture()
def kernels() -> CpuKernels:
    """This machine's kernels (built on first use); the test skips where there is no C++ compiler."""
    found = cpu_kernels()
    if found is None:
        pytest.skip("no working C++ compiler: the native CPU kernels are unavailable (see the KernelWarning)")
    return found


@pytest.fixture()
def forget_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """cpu_kernels() forgotten before and after the test (after: monkeypatch then restores the environment,
    and the next caller builds/loads the real library again)."""
    monkeypatch.delenv("SQUEEZE_CPU_ISA", raising=False)
    cpu_kernels.cache_clear()
    yield
    cpu_kernels.cache_clear()


@pytest.fixture()
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, forget_kernels: None) -> Path:
    """An empty kernel cache directory, used by cpu_kernels() for this test only."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("SQUEEZE_KERNEL_CACHE", str(cache))
    return cache


@functools.cache
def lut_weight(bits: int, n: int, sparse: bool, lut_dtype: str, rows: int = ROWS) -> LutWeight:
    """A quantized random (rows, n) weight; ``sparse``: Fisher-sensitive and outlier weights kept exactly."""
    g = torch.Generator().manual_seed(1000 * bits + n)
    w = torch.randn(rows, n, generator=g)
    if sparse:
        q = quantize_lut(w, w.abs() + 0.1, bits, 0.01, 0.02, lut_dtype=lut_dtype)
        assert q.sparse is not None and q.sparse.nnz > 0  # the case really has a sparse part
    else:
        q = quantize_lut(w, None, bits, lut_dtype=lut_dtype)
        assert q.sparse is None
    assert type(q) is (Lut8Weight if lut_dtype == "int8" else LutWeight)
    return q


def reference(x: torch.Tensor, q: WeightFormat, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 (..., R): x @ W^T + bias with W the reference dequantization (float32)."""
    y = x.double() @ q.dequantize(torch.float32).double().T
    return y + bias.double() if bias is not None else y


def assert_matches(got: torch.Tensor, expected: torch.Tensor, what: object = "") -> None:
    """float32 accumulation in another order than the reference: within 1e-5 of the largest output."""
    assert got.shape == expected.shape, what
    bound = 1e-5 * float(expected.abs().max()) + 1e-6 if expected.numel() else 0.0
    err = float((got.double() - expected).abs().max()) if expected.numel() else 0.0
    assert err <= bound, (what, err, bound)


def kernels_for(kernels: CpuKernels, isa: str) -> CpuKernels:
    if isa == "best":
        return kernels
    if not kernels.supports(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    return kernels.with_isa(isa)


# every case on this machine's best instruction set; a subset on each of the others (the 2- and 8-bit widths
# and the LUT dtype do not depend on the ISA: the blocks at 3 and 4 bits do)
FULL = [(b, n, s, d) for b in BITS for n in IN_FEATURES for s in (False, True) for d in LUT_DTYPES]
SUBSET = [(b, n, True, "float16") for b in (3, 4) for n in IN_FEATURES] + [
    (3, 200, False, "int8"),
    (2, 172, True, "float16"),
    (8, 33, True, "int8"),
]
CASES = [("best", *case) for case in FULL] + [(isa, *case) for isa in ISAS for case in SUBSET]


def float32_bound(x: torch.Tensor, q: LutWeight, bias: torch.Tensor | None, operands: float = 0.0) -> torch.Tensor:
    """float64 (M, R): a rigorous bound on a float32 sum's error in ANY order: (N + nnz + 4) * 2^-24 * sum |terms|,
    the terms being the LUT products, the sparse residual's products and the bias (each output goes through at
    most N + nnz + 2 roundings: products, additions and the horizontal sum; each residual one more).
    ``operands``: a relative error each product may carry besides (rounding both factors to bfloat16: 2^-8)."""
    lut_part = dense_lut_values(q).double().abs()  # (R, N)
    _, cols, resid = sparse_residual(q)
    nnz = int(resid.numel())
    if nnz:
        rows = q.sparse.row_indices() if q.sparse is not None else torch.zeros(0, dtype=torch.int64)
        lut_part = lut_part.index_put((rows, cols.to(torch.int64)), resid.double().abs(), accumulate=True)
    mag = x.double().abs() @ lut_part.T + (bias.double().abs() if bias is not None else 0.0)
    return ((q.in_features + nnz + 4) * 2.0**-24 + operands) * mag + 1e-30


@pytest.mark.parametrize(("isa", "bits", "n", "sparse", "lut_dtype"), CASES)
def test_linear_matches_the_reference(
    kernels: CpuKernels, isa: str, bits: int, n: int, sparse: bool, lut_dtype: str
) -> None:
    """The one matmul at every row count (the fused AVX-512 form up to 4 rows of x, panels above) against the
    float64 product of the reference's dequantized weight, within the rigorous float32 bound."""
    q = lut_weight(bits, n, sparse, lut_dtype)
    prepared = prepare_cpu(q, kernels=kernels_for(kernels, isa), activations="float32")
    assert prepared is not None
    g = torch.Generator().manual_seed(n)
    bias = torch.randn(ROWS, generator=g)
    for batch in (*range(1, 10), 16, 21):
        x = torch.randn(batch, n, generator=g)
        for b in (bias, None):
            got, expected = cpu_lut_linear(x, prepared, b).double(), reference(x, q, b)
            assert bool(((got - expected).abs() <= float32_bound(x, q, b)).all()), (batch, b is None)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize(("bits", "n"), [(3, 200), (3, 576), (4, 172), (2, 33), (8, 7)])
def test_dequantized_rows_are_the_reference_bit_for_bit(kernels: CpuKernels, isa: str, bits: int, n: int) -> None:
    """sq_dequant_rows: rows of W in the kernels' column order, exactly the reference's values."""
    k = kernels_for(kernels, isa)
    for lut_dtype in LUT_DTYPES:
        q = lut_weight(bits, n, True, lut_dtype)
        prepared = prepare_cpu(q, kernels=k, activations="float32")
        assert prepared is not None
        start, stop = 5, 23
        out = torch.full((stop - start, n), float("nan"))
        k.lib.sq_dequant_rows(ctypes.byref(prepared.weight), start, stop, out.data_ptr(), k.isa_code, 1)
        pos = permuted_positions(torch.arange(n), n, bits)
        assert torch.equal(out[:, pos], q.dequantize(torch.float32)[start:stop]), lut_dtype


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("bits", [3, 4])
def test_float16_luts_are_read_in_place_exactly(kernels: CpuKernels, isa: str, bits: int) -> None:
    """The kernels convert each row's float16 LUT themselves: subnormals, signed zeros, the largest half and
    infinities come out as torch's conversion gives them (the ISA paths use F16C, the scalar path bits)."""
    k = kernels_for(kernels, isa)
    special = [6.0e-8, -6.0e-8, 1.0e-5, -0.0, 0.0, 65504.0, -65504.0, float("inf"), -float("inf"), 0.1, -2.5]
    levels = 1 << bits
    values = torch.tensor((special * 8)[: 4 * levels], dtype=torch.float16).view(4, levels)  # (4, 2**bits)
    n = 200
    codes = torch.arange(4 * n, dtype=torch.int64).view(4, n).remainder(levels).to(torch.uint8)
    q = LutWeight(bits=bits, in_features=n, packed=pack_codes(codes, bits), lut=values)
    prepared = prepare_cpu(q, kernels=k, activations="float32")
    assert prepared is not None and prepared.extra_bytes == 0  # no float32 copy of the LUT
    out = torch.empty(4, n)
    k.lib.sq_dequant_rows(ctypes.byref(prepared.weight), 0, 4, out.data_ptr(), k.isa_code, 1)
    expected = q.dequantize(torch.float32)
    got = out[:, permuted_positions(torch.arange(n), n, bits)]
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit for bit, -0.0 included


def test_threads_split_output_rows_without_changing_the_result(kernels: CpuKernels) -> None:
    """Threads split output rows, never a sum: the same bits on 1 or 2 threads (the weight is large enough to
    split), for the fused form (3 rows of x) and the panels (12)."""
    q = lut_weight(4, 1536, True, "float16", rows=300)  # 300 x 768 bytes of codes: above the 64 KiB threshold
    prepared = prepare_cpu(q, kernels=kernels, activations="float32")
    assert prepared is not None
    for batch in (3, 12):
        x = torch.randn(batch, 1536)
        torch.set_num_threads(1)  # the autouse fixture in tests/conftest.py restores the count
        one = cpu_lut_linear(x, prepared)
        torch.set_num_threads(2)
        two = cpu_lut_linear(x, prepared)
        assert torch.equal(one, two), batch
        assert_matches(two, reference(x, q, None), batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lead", [(2, 3), (2, 7)])  # 6 and 14 rows of x
def test_leading_dims_and_dtypes(kernels: CpuKernels, dtype: torch.dtype, lead: tuple[int, int]) -> None:
    q = lut_weight(3, 200, True, "float16")
    prepared = prepare_cpu(q, kernels=kernels, activations="float32")
    assert prepared is not None
    bias = torch.randn(ROWS).to(dtype)
    x = torch.randn(*lead, 200).to(dtype)
    got = cpu_lut_linear(x, prepared, bias)
    assert got.dtype == dtype and got.shape == (*lead, ROWS)
    expected32 = x.float() @ q.dequantize().T + bias.float()  # then rounded to dtype: at most half an ulp off
    # float32 sums in another order (the bound of assert_matches), then one rounding to dtype (float64: none)
    rounding = torch.finfo(dtype).eps if dtype != torch.float64 else 0.0
    bound = rounding * expected32.double().abs() + 1e-5 * float(expected32.abs().max()) + 1e-6
    assert bool(((got.double() - expected32.double()).abs() <= bound).all())


def test_bfloat16_weights_keep_their_exact_sparse_values(kernels: CpuKernels) -> None:
    w = torch.randn(24, 172).to(torch.bfloat16)
    q = quantize_lut(w, None, 4, 0.0, 0.05)
    assert q.sparse is not None and q.sparse.vals.dtype == torch.bfloat16
    prepared = prepare_cpu(q, kernels=kernels, activations="float32")
    assert prepared is not None
    for batch in (2, 11):
        x = torch.randn(batch, 172)
        assert_matches(cpu_lut_linear(x, prepared), reference(x, q, None), batch)


def test_empty_inputs_and_weights(kernels: CpuKernels) -> None:
    q = lut_weight(4, 33, True, "float16")
    prepared = prepare_cpu(q, kernels=kernels, activations="float32")
    assert prepared is not None
    bias = torch.randn(ROWS)
    assert cpu_lut_linear(torch.randn(0, 33), prepared, bias).shape == (0, ROWS)
    assert cpu_lut_linear(torch.randn(2, 0, 33), prepared).shape == (2, 0, ROWS)
    for rows, n in ((0, 40), (5, 0)):  # no output rows; rows of zero columns (y = bias)
        empty = LutWeight(
            bits=3,
            in_features=n,
            packed=pack_codes(torch.zeros(rows, n, dtype=torch.uint8), 3),
            lut=torch.ones(rows, 8),
        )
        p = prepare_cpu(empty, kernels=kernels, activations="float32")
        assert p is not None
        b = torch.randn(rows)
        for batch in (1, 12):
            assert torch.equal(cpu_lut_linear(torch.randn(batch, n), p, b), b.expand(batch, rows)), (rows, n, batch)


@pytest.mark.parametrize(("bits", "n", "sparse"), [(4, 576, True), (3, 200, True), (4, 33, False), (2, 172, True)])
def test_the_bfloat16_form_matches_the_reference(kernels: CpuKernels, bits: int, n: int, sparse: bool) -> None:
    """activations="bfloat16" on AVX-512 BF16: within the float32 bound plus 2^-8 per product (both factors
    rounded to bfloat16); elsewhere the float32 form, with the float32 bound."""
    q = lut_weight(bits, n, sparse, "float16")
    prepared = prepare_cpu(q, kernels=kernels, activations="bfloat16")
    assert prepared is not None
    expected_bf16 = kernels.isa == "avx512" and bool(kernels.lib.sq_bf16_supported())
    assert prepared.bf16 == expected_bf16 and prepared.activations == ("bfloat16" if expected_bf16 else "float32")
    g = torch.Generator().manual_seed(n)
    bias = torch.randn(ROWS, generator=g)
    for batch in (1, 3, 4, 5, 21):
        x = torch.randn(batch, n, generator=g)
        got, expected = cpu_lut_linear(x, prepared, bias).double(), reference(x, q, bias)
        bound = float32_bound(x, q, bias, 2.0**-8 if expected_bf16 else 0.0)
        assert bool(((got - expected).abs() <= bound).all()), batch
    if expected_bf16:  # really another form: not the float32 bits
        exact = prepare_cpu(q, kernels=kernels, activations="float32")
        assert exact is not None and not torch.equal(cpu_lut_linear(x, prepared), cpu_lut_linear(x, exact))


# ---------------------------------------------------------------------------------------------------------
# The kernels' column order (cpu_lut.cpp's header comment), golden


def test_permuted_positions_at_4_bits() -> None:
    # one block of 16 one-byte groups (CPG = 2): column 2i + s at position 16s + i; columns 32, 33 natural
    expected = [0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23]
    expected += [8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31, 32, 33]
    assert permuted_positions(torch.arange(34), 34, 4).tolist() == expected
    # the second block starts at 32
    assert permuted_positions(torch.tensor([32, 33, 34, 63, 64, 65]), 66, 4).tolist() == [32, 48, 33, 63, 64, 65]


def test_permuted_positions_at_3_bits() -> None:
    # n = 197: a block (CPG = 8: column 8i + s at position 16s + i), the half block of 64 columns at 128
    # (column 128 + 8i + s at position 128 + 8s + i), then 192..196 in natural order
    cols = [0, 1, 7, 8, 9, 126, 127, 128, 129, 135, 136, 190, 191, 192, 196]
    expected = [0, 16, 112, 1, 17, 111, 127, 128, 136, 184, 129, 183, 191, 192, 196]
    assert permuted_positions(torch.tensor(cols), 197, 3).tolist() == expected
    # 63 columns after the block: no half block, the tail is natural
    assert permuted_positions(torch.tensor([1, 128, 129, 190]), 191, 3).tolist() == [16, 128, 129, 190]
    # 64 columns only: the half block alone
    assert permuted_positions(torch.tensor([0, 1, 8, 63]), 64, 3).tolist() == [0, 8, 1, 63]


@pytest.mark.parametrize("bits", [2, 8])
def test_permuted_positions_are_natural_without_blocks(bits: int) -> None:
    assert torch.equal(permuted_positions(torch.arange(300), 300, bits), torch.arange(300))


@pytest.mark.parametrize("bits", BITS)
def test_permute_x_agrees_with_permuted_positions(kernels: CpuKernels, bits: int) -> None:
    for n in (0, 1, 31, 32, 34, 63, 64, 66, 127, 128, 191, 192, 197, 200, 576):
        x = torch.randn(3, n)
        xp = torch.full_like(x, float("nan"))
        kernels.lib.sq_permute_x(x.data_ptr(), xp.data_ptr(), 3, n, bits)
        pos = permuted_positions(torch.arange(n), n, bits)
        assert torch.equal(torch.sort(pos).values, torch.arange(n)), n  # a permutation
        assert torch.equal(xp[:, pos], x), n


# ---------------------------------------------------------------------------------------------------------
# Build, cache and fallbacks


def test_the_library_is_built_once_into_the_cache(fresh_cache: Path) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on PATH")
    first = cpu_kernels()
    assert first is not None and first.path.parent == fresh_cache and first.path.is_file()
    assert first.path.name.startswith("squeeze_cpu_lut-") and first.path.suffix == ".so"
    assert [p.name for p in fresh_cache.iterdir()] == [first.path.name]  # no temporary file left behind
    mtime = first.path.stat().st_mtime_ns
    cpu_kernels.cache_clear()
    second = cpu_kernels()
    assert second is not None and second.path == first.path and second.path.stat().st_mtime_ns == mtime


def _kernel_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KernelWarning)]


def test_without_a_compiler_one_warning_and_the_dense_path(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    q = lut_weight(4, 172, True, "float16")
    bias = torch.randn(ROWS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernels() is None and cpu_kernels() is None
        module = SqueezeLinear(q, bias)
        low = SqueezeLinear(q, bias, low_memory=True)
    messages = _kernel_warnings(caught)
    assert len(messages) == 1 and "no C++ compiler" in messages[0] and "/nonexistent/g++" in messages[0]
    assert prepare_cpu(q) is None
    assert module.weight_path == "dense" and low.weight_path == "chunked"
    x = torch.randn(3, 172)
    assert torch.equal(module(x), F.linear(x, q.dequantize(), bias))
    assert_matches(low(x), reference(x, q, bias))
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())


def test_a_failing_compiler_warns_and_returns_none(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable")
    monkeypatch.setenv("CXX", false)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernels() is None
    messages = _kernel_warnings(caught)
    assert len(messages) == 1 and "false failed" in messages[0]
    assert not any(fresh_cache.iterdir())  # the failed build's temporary file is removed


def test_an_unwritable_cache_warns_and_returns_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget_kernels: None
) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on PATH")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SQUEEZE_KERNEL_CACHE", str(blocker / "kernels"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernels() is None
    messages = _kernel_warnings(caught)
    assert len(messages) == 1 and "kernel cache" in messages[0]


def test_squeeze_cpu_isa_caps_the_instruction_set(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, forget_kernels: None
) -> None:
    best = next(isa for isa in ISAS if kernels.supports(isa))
    monkeypatch.setenv("SQUEEZE_CPU_ISA", "scalar")
    cpu_kernels.cache_clear()
    capped = cpu_kernels()
    assert capped is not None and capped.isa == "scalar"
    assert SqueezeLinear(lut_weight(4, 33, False, "float16")).weight_path == "native-scalar"
    monkeypatch.setenv("SQUEEZE_CPU_ISA", "AVX2")  # case-insensitive
    cpu_kernels.cache_clear()
    capped = cpu_kernels()
    assert capped is not None and capped.isa == ("avx2" if kernels.supports("avx2") else "scalar")
    monkeypatch.setenv("SQUEEZE_CPU_ISA", "sse9")
    cpu_kernels.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignored = cpu_kernels()
    messages = _kernel_warnings(caught)
    assert len(messages) == 1 and "sse9" in messages[0]
    assert ignored is not None and ignored.isa == best


def test_with_isa_refuses_an_unknown_instruction_set(kernels: CpuKernels) -> None:
    assert kernels.supports("scalar") and not kernels.supports("neon")
    with pytest.raises(ValueError, match="neon"):
        kernels.with_isa("neon")


# ---------------------------------------------------------------------------------------------------------
# SqueezeLinear's path


@pytest.mark.parametrize("lut_dtype", LUT_DTYPES)
def test_lut_weights_run_natively_by_default(kernels: CpuKernels, lut_dtype: str) -> None:
    q = lut_weight(3, 200, True, lut_dtype)
    bias = torch.randn(ROWS)
    # the float32 path (the int8 one: tests/runtime/test_cpu_w8.py); the kernel needs no chunks
    exact = {"activations": "float32"}
    for module in (SqueezeLinear(q, bias, **exact), SqueezeLinear(q, bias, low_memory=True, **exact)):
        assert module.weight_path == f"native-{kernels.isa}"
        prepared = module._cpu
        assert prepared is not None
        # the codes and the LUT (fp16 values; or uint8 levels with fp16 scale/zero) are read in place
        own = {t.data_ptr() for t in module.buffers()}
        assert {t.data_ptr() for t in prepared.keep[:2]} <= own
        assert q.sparse is not None and q.sparse.vals.dtype == torch.float32 and q.sparse.rowptr.dtype == torch.int32
        assert prepared.extra_bytes == q.sparse.nnz * 8  # only the positions and residuals: vals are float32
        xs = [torch.randn(batch, 200) for batch in (1, 5, 12)]
        expected = [reference(x, q, bias) for x in xs]
        with pytest.MonkeyPatch.context() as m:  # the dense weight is never built, not even for a moment
            m.setattr(LutWeight, "dequantize", lambda *a, **k: pytest.fail("the native path dequantized W"))
            for x, y in zip(xs, expected, strict=True):
                assert_matches(module(x), y, x.shape)
        assert module._dense is None


def test_dense_cache_pins_the_reference_path(kernels: CpuKernels) -> None:
    q = lut_weight(4, 172, True, "float16")
    bias = torch.randn(ROWS)
    module = SqueezeLinear(q, bias, dense_cache=True)
    assert module.weight_path == "dense" and module._cpu is None
    x = torch.randn(3, 172)
    assert torch.equal(module(x), F.linear(x, q.dequantize(), bias))


def test_formats_without_a_native_kernel(kernels: CpuKernels) -> None:
    q = rtn_quantize(torch.randn(ROWS, 172), 4, group_size=32)
    bias = torch.randn(ROWS)
    dense, low = SqueezeLinear(q, bias), SqueezeLinear(q, bias, low_memory=True)
    assert dense.weight_path == "dense" and low.weight_path == "chunked"
    low.chunk_rows = 16
    x = torch.randn(3, 172)
    assert torch.equal(dense(x), F.linear(x, q.dequantize(), bias))
    torch.testing.assert_close(low(x), F.linear(x, q.dequantize(), bias), rtol=1e-5, atol=1e-5)


def test_inputs_that_need_gradients_take_the_reference_path(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = lut_weight(4, 172, True, "float16")
    bias = torch.randn(ROWS)
    module = SqueezeLinear(q, bias, activations="float32")
    calls = [0]

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return cpu_lut_linear(*args)

    monkeypatch.setattr("squeeze.runtime.linear.cpu_lut_linear", counted)
    x = torch.randn(3, 172, requires_grad=True)
    y = module(x)
    assert calls == [0] and torch.equal(y, F.linear(x, q.dequantize(), bias))
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, q.dequantize().sum(0).expand(3, 172))
    with torch.no_grad():  # no gradient wanted: the kernels again
        assert_matches(module(x), reference(x.detach(), q, bias))
    assert calls == [1]


def test_half_and_moves_reprepare_the_kernels(kernels: CpuKernels) -> None:
    q = lut_weight(4, 172, True, "float16")
    module = SqueezeLinear(q, torch.randn(ROWS), activations="float32")
    keys = set(module.state_dict())
    assert keys == set(q.tensors_by_role()) | {"bias"}  # the kernels' form is no buffer
    module.half()  # sparse values and bias become float16: the kernels are prepared from the new buffers
    assert module.weight_path == f"native-{kernels.isa}"
    moved = module.qweight
    assert isinstance(moved, LutWeight) and moved.sparse is not None and moved.sparse.vals.dtype == torch.float16
    assert module.bias is not None
    x = torch.randn(2, 3, 172).to(torch.float16)
    expected = x.float() @ module.qweight.dequantize().T + module.bias.float()
    got = module(x)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=torch.finfo(torch.float16).eps, atol=1e-5)
    module.to("cpu")  # a move (here a no-op one) prepares the kernels again too
    assert module.weight_path == f"native-{kernels.isa}"
    x = torch.randn(4, 172)
    assert_matches(module(x), reference(x, module.qweight, module.bias))
    assert set(module.state_dict()) == keys


def test_rebind_after_an_in_place_change(kernels: CpuKernels) -> None:
    q = lut_weight(4, 172, True, "float16")
    module = SqueezeLinear(
        LutWeight(bits=4, in_features=172, packed=q.packed.clone(), lut=q.lut.clone(), sparse=q.sparse),
        activations="float32",
    )
    module.get_buffer("weight_lut").mul_(2)
    module.rebind()  # the float32 LUT the kernels read is prepared again from the buffers
    x = torch.randn(3, 172)
    assert_matches(module(x), reference(x, module.qweight, None))


def test_load_state_dict_reaches_the_kernels(kernels: CpuKernels) -> None:
    target = SqueezeLinear(lut_weight(4, 172, False, "float16"), activations="float32")
    source = SqueezeLinear(quantize_lut(torch.randn(ROWS, 172), None, 4))  # another weight of the same shape
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 172)
    assert_matches(target(x), reference(x, source.qweight, None))
