"""LUT kernels: torch references, the kernels' tile layout, and the Triton kernels under TRITON_INTERPRET=1.

The Triton kernels run here in Triton's CPU interpreter on tiny shapes (it executes each program in numpy,
so it checks indexing, masks, packing and the math, not speed); scripts/device/gpu_check.py runs them on a GPU.
Known interpreter differences, reflected in the bfloat16 tolerances: it truncates float32 -> bfloat16
instead of rounding to nearest, and its tl.dot cannot take bfloat16 (the launcher upcasts on CPU).
"""

from __future__ import annotations

import os

# before triton (or any module that decorates kernels) is imported: kernels then run on CPU tensors
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from squeeze.quant.packing import pack_codes  # noqa: E402
from squeeze.quant.schemes import LutWeight  # noqa: E402
from squeeze.quant.sparse import SparseCSR  # noqa: E402
from squeeze.runtime.kernels import (  # noqa: E402
    GemmConfig,
    GemvConfig,
    csr_spmv_reference,
    dense_lut_values,
    lut_dequantize,
    lut_linear,
    lut_matmul_reference,
    prepare,
    sparse_residual,
    tile_pack,
    tile_unpack,
    triton_available,
)
from squeeze.runtime.kernels.dispatch import lut_forward, prepared_for  # noqa: E402
from squeeze.runtime.linear import SqueezeLinear  # noqa: E402

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install triton; its CPU interpreter runs these)"
)


def make_weight(
    rows: int,
    cols: int,
    bits: int,
    sparse_fraction: float = 0.0,
    *,
    seed: int = 0,
    vals_dtype: torch.dtype = torch.float32,
) -> LutWeight:
    """A random LutWeight: random codes, ascending fp16 LUTs, and (optionally) a random sparse part."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), dtype=torch.uint8, generator=g)
    lut = torch.randn(rows, 1 << bits, generator=g).sort(dim=1).values.to(torch.float16)
    sparse = None
    if sparse_fraction:
        mask = torch.rand(rows, cols, generator=g) < sparse_fraction
        values = (torch.randn(rows, cols, generator=g) * 3).to(vals_dtype)
        sparse = SparseCSR.from_mask(mask, values)
    return LutWeight(bits=bits, in_features=cols, packed=pack_codes(codes, bits), lut=lut, sparse=sparse)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|, in float32."""
    y, ref = y.to(torch.float32), ref.to(torch.float32)
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------
# torch only: references and layout


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [1, 33, 172, 520])
def test_tile_pack_round_trip(bits: int, cols: int) -> None:
    codes = make_weight(5, cols, bits).codes()
    for tile in (16, 64):
        tiles = tile_pack(codes, bits, tile)
        cpg = {2: 4, 3: 8, 4: 2, 8: 1}[bits]
        assert tiles.dtype == torch.uint8 and tiles.shape[1] == -(-cols // (cpg * tile))
        assert torch.equal(tile_unpack(tiles, bits, cols), codes)


def test_tile_layout_golden() -> None:
    # 4 bits, T = 16: tile 0 holds columns 0..31; group t's byte = code(t) | code(16 + t) << 4
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    tiles = tile_pack(codes, 4, 16)
    assert tiles.shape == (1, 1, 1, 16)
    assert tiles[0, 0, 0, 3].item() == 3 | (3 << 4)  # columns 3 and 19 both hold code 3
    # 3 bits, T = 16: group t's 24-bit word holds columns t, 16+t, ..., 112+t at 3 bits each
    codes3 = (torch.arange(128) // 16).to(torch.uint8).view(1, 128)  # column c holds c // 16 = its slot
    word = sum(s << (3 * s) for s in range(8))
    tiles3 = tile_pack(codes3, 3, 16)
    assert [tiles3[0, 0, p, 5].item() for p in range(3)] == [(word >> (8 * p)) & 0xFF for p in range(3)]


def test_codes_at_reads_the_tile_layout() -> None:
    q = make_weight(7, 100, 3, 0.1)
    p = prepare(q, "cpu", tile=16)
    rows, cols = p.sparse_positions()
    assert rows.numel() == q.sparse.nnz
    assert torch.equal(p.codes_at(rows, cols), q.codes()[rows, cols].to(torch.int64))


@pytest.mark.parametrize("vals_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_residual_turns_replace_into_add(vals_dtype: torch.dtype) -> None:
    q = make_weight(9, 70, 4, 0.2, vals_dtype=vals_dtype)
    rowptr, cols, resid = sparse_residual(q)
    assert rowptr.dtype == torch.int32 and cols.dtype == torch.int32 and resid.dtype == torch.float32
    assert torch.equal(rowptr, q.sparse.rowptr) and torch.equal(cols.to(torch.int64), q.sparse.cols.to(torch.int64))
    added = dense_lut_values(q)
    added[q.sparse.row_indices(), cols.to(torch.int64)] += resid
    exact = q.dequantize(torch.float32)
    if vals_dtype == torch.float32:
        # two float32 roundings: resid = fl(v - l), then fl(l + resid); each within half an ulp of |v| + |l|
        bound = 2**-23 * (exact.abs() + dense_lut_values(q).abs())
        assert bool(((added - exact).abs() <= bound).all())
    else:
        # a 16-bit weight minus a float16 LUT value is exact in float32 (for these magnitudes): so is the sum
        assert torch.equal(added, exact)
    # x @ (dense + S)^T == the replace-semantics product
    x = torch.randn(3, 70)
    y = x @ dense_lut_values(q).T + csr_spmv_reference(x, rowptr, cols, resid)
    torch.testing.assert_close(y, lut_matmul_reference(x, q), rtol=1e-5, atol=1e-5)


def test_sparse_residual_without_sparse_part() -> None:
    rowptr, cols, resid = sparse_residual(make_weight(4, 10, 3))
    assert torch.equal(rowptr, torch.zeros(5, dtype=torch.int32)) and cols.numel() == 0 and resid.numel() == 0


def test_csr_spmv_reference_matches_dense() -> None:
    q = make_weight(6, 40, 4, 0.3)
    mask, values = q.sparse.to_dense_mask_and_values()
    x = torch.randn(2, 5, 40)
    y = csr_spmv_reference(x, q.sparse.rowptr, q.sparse.cols, q.sparse.vals)
    assert y.shape == (2, 5, 6)
    torch.testing.assert_close(y, x @ (values * mask).T, rtol=1e-5, atol=1e-5)


def test_prepare_contents() -> None:
    q = make_weight(5, 33, 3, 0.1)
    p = prepare(q, "cpu")
    assert p.codes.shape == (5, 1, 3, 128) and p.lut.dtype == torch.float32 and p.has_sparse
    assert p.nnz == q.sparse.nnz and p.cols.dtype == torch.int32
    assert not prepare(make_weight(5, 33, 4), "cpu").has_sparse
    empty = SparseCSR.from_mask(torch.zeros(5, 33, dtype=torch.bool), torch.zeros(5, 33))
    q_empty = LutWeight(bits=3, in_features=33, packed=q.packed, lut=q.lut, sparse=empty)
    assert not prepare(q_empty, "cpu").has_sparse  # nothing to add: the kernels skip the sparse pass


# ------------------------------------------------------------------------------------------------------
# Triton kernels (interpreter)


@needs_triton
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("rows,cols", [(8, 33), (8, 64), (33, 172)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_lut_linear_float32(bits: int, rows: int, cols: int, m: int) -> None:
    for sparse in (0.0, 0.05):
        q = make_weight(rows, cols, bits, sparse, seed=rows * cols + m)
        x = torch.randn(m, cols)
        y = lut_linear(x, prepare(q, "cpu"))
        assert y.shape == (m, rows) and y.dtype == torch.float32
        assert rel_err(y, lut_matmul_reference(x, q)) < 1e-5, (bits, rows, cols, m, sparse)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 20])
def test_lut_linear_half_precision(dtype: torch.dtype, m: int) -> None:
    q = make_weight(33, 172, 4, 0.05, seed=7)
    x = torch.randn(m, 172).to(dtype)
    bias = torch.randn(33).to(dtype)
    y = lut_linear(x, prepare(q, "cpu"), bias)
    assert y.dtype == dtype and y.shape == (m, 33)
    # one output rounding (the interpreter truncates to bfloat16: up to 2**-7 relative), and for the GEMM
    # the weight tile in x's dtype
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    assert rel_err(y, lut_matmul_reference(x, q, bias)) < tol


@needs_triton
@pytest.mark.parametrize("bits", [2, 8])
def test_lut_linear_other_widths(bits: int) -> None:
    q = make_weight(9, 45, bits, 0.05, seed=bits)
    p = prepare(q, "cpu", tile=16)
    for m in (1, 17):
        x = torch.randn(m, 45)
        assert rel_err(lut_linear(x, p), lut_matmul_reference(x, q)) < 1e-5


@needs_triton
def test_gemv_configs_agree() -> None:
    """Split-K (atomics), elementwise and tensor-core accumulation, prefetch depths, Triton's pipeliner,
    several sparse steps and other tiles: the same result."""
    q = make_weight(33, 300, 3, 0.1, seed=3)  # rows hold ~30 sparse entries: several steps of sparse_block 4
    bias = torch.randn(33)
    for tile, m in ((16, 4), (128, 1), (32, 8)):
        x = torch.randn(m, 300)
        ref = lut_matmul_reference(x, q, bias)
        p = prepare(q, "cpu", tile=tile)
        for cfg in (
            GemvConfig(block_r=4, split_k=3, sparse_block=4, mma=False, prefetch=1),
            GemvConfig(block_r=32, num_warps=2, sparse_block=32, prefetch=0, num_stages=2),
            GemvConfig(block_r=16, split_k=2),
        ):
            assert rel_err(lut_linear(x, p, bias, gemv=cfg), ref) < 1e-5, (tile, cfg)


@needs_triton
def test_gemm_config_and_dense_sparse_row() -> None:
    """A row whose every weight is sparse, a GEMM tile larger than M and R, bias, leading dims."""
    q = make_weight(20, 50, 4, 0.05, seed=5)
    mask, values = q.sparse.to_dense_mask_and_values()
    mask[3] = True
    values[3] = torch.randn(50)
    q = LutWeight(bits=4, in_features=50, packed=q.packed, lut=q.lut, sparse=SparseCSR.from_mask(mask, values))
    x = torch.randn(2, 9, 50)
    bias = torch.randn(20)
    p = prepare(q, "cpu", tile=16)
    ref = lut_matmul_reference(x, q, bias)
    for cfg in (GemmConfig(block_m=16, block_n=16, num_warps=4, sparse_block=4), GemmConfig(block_m=64)):
        y = lut_linear(x, p, bias, gemm=cfg)
        assert y.shape == (2, 9, 20) and rel_err(y, ref) < 1e-5
    assert rel_err(lut_linear(x[0, :3], p, bias), ref[0, :3]) < 1e-5  # GEMV
    assert rel_err(lut_linear(x, p, bias, prefill="dequant"), ref) < 1e-5  # dequantize + matmul
    x_strided = torch.randn(50, 3).T  # non-contiguous rows
    assert rel_err(lut_linear(x_strided, p), lut_matmul_reference(x_strided, q)) < 1e-5


@needs_triton
def test_empty_shapes_and_errors() -> None:
    q = make_weight(4, 0, 4)
    bias = torch.randn(4)
    assert torch.equal(lut_linear(torch.randn(3, 0), prepare(q, "cpu"), bias), bias.expand(3, 4))
    p = prepare(make_weight(4, 8, 4), "cpu")
    assert lut_linear(torch.randn(0, 8), p).shape == (0, 4)
    with pytest.raises(Exception, match="shape"):
        lut_linear(torch.randn(2, 9), p)
    with pytest.raises(Exception, match="float16"):
        lut_linear(torch.randn(2, 8).to(torch.float64), p)


@needs_triton
def test_lut_dequantize_is_exact() -> None:
    q = make_weight(33, 172, 3, 0.05, vals_dtype=torch.bfloat16)
    p = prepare(q, "cpu")
    assert torch.equal(lut_dequantize(p, torch.float32), q.dequantize(torch.float32))
    assert torch.equal(lut_dequantize(p, torch.float16), q.dequantize(torch.float16))


@needs_triton
def test_dispatch_lut_forward() -> None:
    q = make_weight(12, 40, 4, 0.05)
    module = SqueezeLinear(q, torch.randn(12))
    x = torch.randn(2, 40)
    assert lut_forward(x, module) is None  # CPU tensors take the reference path
    with torch.no_grad():
        y = lut_forward(x, module, allow_cpu=True)
        assert y is not None and rel_err(y, dense_linear(x, module)) < 1e-5
        first = prepared_for(module, x.device)
        assert prepared_for(module, x.device) is first  # cached
        module.weight_lut.mul_(2)
        module.rebind()  # buffers changed in place: layouts are prepared again from the new values
        assert prepared_for(module, x.device) is not first
        second = prepared_for(module, x.device)
        module.to(x.device)  # a move (here a no-op one) also rebuilds the layouts, never forward
        assert prepared_for(module, x.device) is not second
        assert rel_err(lut_forward(x, module, allow_cpu=True), dense_linear(x, module)) < 1e-5
    assert lut_forward(x.requires_grad_(), module, allow_cpu=True) is None  # no backward in the kernels


def dense_linear(x: torch.Tensor, module: SqueezeLinear) -> torch.Tensor:
    """The reference product from the module's live buffers (its dense cache would be stale after mul_)."""
    return torch.nn.functional.linear(x, module.dequantize(), module.bias)


@pytest.fixture(autouse=True, scope="module")
def _interpreted_kernels():
    """Reload the kernels if another test module imported them before TRITON_INTERPRET was set."""
    mod = sys.modules.get("squeeze.runtime.kernels._triton_kernels")
    if mod is not None and triton_available():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod._lut_gemv_kernel, InterpretedFunction):
            importlib.reload(mod)
    yield


@needs_triton
@pytest.mark.parametrize("m", [1, 16])
def test_lut_linear_with_an_8bit_lut(m: int) -> None:
    from squeeze.quant.schemes.lut import quantize_lut

    g = torch.Generator().manual_seed(11)
    q = quantize_lut(torch.randn(33, 172, generator=g), None, 3, 0.004, 0.01, lut_dtype="int8")
    x = torch.randn(m, 172, generator=g)
    assert torch.equal(dense_lut_values(q), q.lut_values().gather(1, q.codes().long()))
    y = lut_linear(x, prepare(q, "cpu"))
    assert rel_err(y, lut_matmul_reference(x, q)) < 1e-5
