"""Triton kernels for LUT-quantized linears. Imports triton at module level: import it only through
:mod:`squeeze.runtime.kernels.triton_lut`, which does so lazily.

All kernels read the tile-permuted code layout of :mod:`squeeze.runtime.kernels.layout`: codes uint8
(R, NT, BPG, T); in tile k, group t's word (BPG little-endian byte planes, T bytes apart) holds in bits
[s*BITS, (s+1)*BITS) the code of column ``k*CPG*T + s*T + t``. For each slot s the T codes and the T
activations are contiguous. The LUT is float32 (R, L) with L = 2**BITS. The optional sparse part is an
ADDITIVE residual in CSR form (rowptr int32, cols int32, resid float32): y += x @ S^T.

Rows past R (and activation rows past M) are CLAMPED to the last valid one instead of masked: code, LUT
and activation-row loads stay in bounds without masks, and only the final store is masked. Columns past
N exist only in the padded last tile: their codes are 0 and their activations are loaded (masked) as 0,
so they add 0 (assuming finite LUT entries, which k-means centroids of finite weights are).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_words(ptrs, BPG: tl.constexpr, T: tl.constexpr):
    """The words of the groups whose byte plane 0 is at ``ptrs`` (BPG byte planes, T bytes apart): the raw
    uint8 bytes when BPG == 1 (4 per register while they wait in a prefetch), else int32."""
    # codes are read exactly once per call: do not let them evict the LUTs and activations from cache
    word = tl.load(ptrs, eviction_policy="evict_first")
    if BPG > 1:
        word = word.to(tl.int32)
        for p in tl.static_range(1, BPG):
            word |= tl.load(ptrs + p * T, eviction_policy="evict_first").to(tl.int32) << (8 * p)
    return word


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + a @ b. DOT_UPCAST: float32 copies of the (already rounded) operands, the same products, for
    Triton's CPU interpreter whose tl.dot cannot multiply bfloat16; FP32_DOT: exact float32 products
    (tf32 would drop 13 mantissa bits)."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif FP32_DOT:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gemv_tile(
    acc,
    word,
    x_ptr,
    x_rows,
    lut_rows,
    k,
    offs_t,
    N,
    BITS: tl.constexpr,
    CPG: tl.constexpr,
    T: tl.constexpr,
    MODE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """acc += the products of code tile k (its words (BLOCK_R, T)) with the activations.

    MODE 0 (one activation row at x_ptr): acc (BLOCK_R, T), elementwise. MODE 1: acc (BLOCK_M, BLOCK_R, T),
    elementwise with x_rows (BLOCK_M, 1). MODE 2: acc (BLOCK_M, BLOCK_R) by tl.dot on the tensor cores,
    the weight tile rounded to x's dtype (BLOCK_M, BLOCK_R >= 16).
    """
    word = word.to(tl.int32)
    for s in tl.static_range(CPG):
        # the LUT rows are a few cache lines each, L1-resident: a gathered load per weight (tl.gather from
        # registers compiles to several shuffles per weight, and Triton 3.6 rejects it on some tiles)
        w = tl.load(lut_rows + ((word >> (s * BITS)) & ((1 << BITS) - 1)))  # (BLOCK_R, T) float32
        cols = k * (CPG * T) + s * T + offs_t  # (T,)
        if MODE == 0:
            xs = tl.load(x_ptr + cols, mask=cols < N, other=0.0)  # (T,)
            acc += w * xs.to(tl.float32)[None, :]
        elif MODE == 1:
            xs = tl.load(x_rows + cols[None, :], mask=cols[None, :] < N, other=0.0)  # (BLOCK_M, T)
            acc += xs.to(tl.float32)[:, None, :] * w[None, :, :]
        else:
            xs = tl.load(x_rows + cols[None, :], mask=cols[None, :] < N, other=0.0)  # (BLOCK_M, T)
            acc = _dot(xs, tl.trans(w.to(x_ptr.dtype.element_ty)), acc, FP32_DOT, DOT_UPCAST)
    return acc


@triton.jit
def _lut_gemv_kernel(
    x_ptr,
    codes_ptr,
    lut_ptr,
    rowptr_ptr,
    cols_ptr,
    resid_ptr,
    bias_ptr,
    out_ptr,
    M,
    R,
    N,
    NT,
    TILES_PER_SPLIT,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    CPG: tl.constexpr,
    BPG: tl.constexpr,
    T: tl.constexpr,
    L: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SP: tl.constexpr,
    HAS_SPARSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,
    PREFETCH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MODE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Decode GEMV, out (M, R) = x (M, N) @ W^T (+ S) (+ bias), M <= BLOCK_M (<= 8, or 16 in MODE 2).
    MODE: how products accumulate (``_gemv_tile``): 0 for M == 1, 1 or 2 (tensor cores) for M > 1.

    Grid (cdiv(R, BLOCK_R), SPLIT_K). Program (i, j) owns rows [i*BLOCK_R, (i+1)*BLOCK_R) and tiles
    [j*TILES_PER_SPLIT, (j+1)*TILES_PER_SPLIT). With ATOMIC (split-K) it adds its float32 partial into
    a zeroed float32 out; split 0 also adds the sparse part and the bias.
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    rows_c = tl.minimum(rows, R - 1)
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_t = tl.arange(0, T)  # (T,)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm  # (BLOCK_M, 1)
    code_ptrs = codes_ptr + rows_c.to(tl.int64)[:, None] * (NT * BPG * T) + offs_t[None, :]  # (BLOCK_R, T)
    lut_rows = lut_ptr + rows_c[:, None] * L  # (BLOCK_R, 1)

    # MODE 0/1: elementwise accumulators, reduced over T once after the loop. M == 1 gets a 2-D one: with
    # a (1, BLOCK_R, T) one Triton shuffles the decoded tiles through shared memory to match layouts.
    if MODE == 0:
        acc = tl.zeros((BLOCK_R, T), dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_R, T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = pid_k * TILES_PER_SPLIT
    k_end = tl.minimum(k_begin + TILES_PER_SPLIT, NT)
    tile_bytes: tl.constexpr = BPG * T
    if PREFETCH == 0:
        # NUM_STAGES > 1: Triton's pipeliner prefetches through shared memory (cp.async); it also stages
        # the LUT gathers there, which costs a lot of shared memory
        for k in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
            word = _tile_words(code_ptrs + k * tile_bytes, BPG, T)  # (BLOCK_R, T)
            acc = _gemv_tile(acc, word, x_ptr, x_rows, lut_rows, k, offs_t, N, BITS, CPG, T, MODE, FP32_DOT, DOT_UPCAST)
    else:
        # register prefetch: the codes of the next PREFETCH tiles are in flight while this one is computed
        # (each thread holds only a few bytes of codes per tile). Past the end, the last tile is re-read.
        last = k_end - 1
        w0 = _tile_words(code_ptrs + k_begin * tile_bytes, BPG, T)  # (BLOCK_R, T)
        if PREFETCH == 2:
            w1 = _tile_words(code_ptrs + tl.minimum(k_begin + 1, last) * tile_bytes, BPG, T)
        for k in range(k_begin, k_end):
            nxt = _tile_words(code_ptrs + tl.minimum(k + PREFETCH, last) * tile_bytes, BPG, T)
            acc = _gemv_tile(acc, w0, x_ptr, x_rows, lut_rows, k, offs_t, N, BITS, CPG, T, MODE, FP32_DOT, DOT_UPCAST)
            if PREFETCH == 2:
                w0 = w1
                w1 = nxt
            else:
                w0 = nxt
    if MODE == 0:
        y = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_R)
    elif MODE == 1:
        y = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_R)
    else:
        y = acc  # (BLOCK_M, BLOCK_R)

    if HAS_SPARSE:
        start = tl.load(rowptr_ptr + rows_c)  # (BLOCK_R,)
        # only split 0 adds the sparse part: the others see empty rows
        count = tl.where(pid_k == 0, tl.load(rowptr_ptr + rows_c + 1) - start, 0)  # (BLOCK_R,)
        offs_j = tl.arange(0, SP)  # (SP,)
        sacc = tl.zeros((BLOCK_M, BLOCK_R, SP), dtype=tl.float32)
        # SP entries of every row per step: all their loads are in flight together; as many steps as the
        # block's longest row needs
        max_count = tl.max(count, axis=0)
        j0 = 0
        while j0 < max_count:
            has = (j0 + offs_j)[None, :] < count[:, None]  # (BLOCK_R, SP)
            idx = start[:, None] + j0 + offs_j[None, :]  # (BLOCK_R, SP)
            c = tl.load(cols_ptr + idx, mask=has, other=0)
            v = tl.load(resid_ptr + idx, mask=has, other=0.0)
            xv = tl.load(x_rows[:, :, None] + c[None, :, :]).to(tl.float32)  # (BLOCK_M, BLOCK_R, SP)
            sacc += xv * v[None, :, :]
            j0 += SP
        y += tl.sum(sacc, axis=2)

    if HAS_BIAS:
        b = tl.load(bias_ptr + rows_c).to(tl.float32)  # (BLOCK_R,)
        y += tl.where(pid_k == 0, b, 0.0)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + rows[None, :]  # (BLOCK_M, BLOCK_R)
    out_mask = (offs_m[:, None] < M) & (rows[None, :] < R)
    if ATOMIC:
        tl.atomic_add(out_ptrs, y, mask=out_mask)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _lut_gemm_kernel(
    x_ptr,
    codes_ptr,
    lut_ptr,
    sparse_ptr,
    bias_ptr,
    out_ptr,
    M,
    R,
    N,
    NT,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    CPG: tl.constexpr,
    BPG: tl.constexpr,
    T: tl.constexpr,
    L: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_SPARSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Prefill GEMM, out (M, R) = x (M, N) @ W^T (+ sparse (M, R) float32) (+ bias).

    1-D grid over (cdiv(M, BLOCK_M), cdiv(R, BLOCK_N)) output tiles in grouped order (GROUP_M row tiles
    share each weight tile while it is in L2). Per K step (BLOCK_K groups of one code tile, BLOCK_K
    dividing T): decode the (BLOCK_K, BLOCK_N) codes of each slot s, look them up into a W^T tile in x's
    dtype, and tl.dot it with the matching (BLOCK_M, BLOCK_K) activation tile. The sparse part comes
    precomputed (``_csr_spmm_kernel``) and is added before the single rounding to out's dtype.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(R, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_mc = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    rows_c = tl.minimum(rows, R - 1)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    x_rows = x_ptr + offs_mc[:, None] * stride_xm  # (BLOCK_M, 1)
    # (BLOCK_K, BLOCK_N): built K-major, the shape tl.dot wants for its second operand
    code_ptrs = codes_ptr + rows_c.to(tl.int64)[None, :] * (NT * BPG * T) + offs_k[:, None]
    lut_rows = lut_ptr + rows_c[None, :] * L  # (1, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, NT * (T // BLOCK_K)):
        k = kk // (T // BLOCK_K)  # code tile
        t0 = (kk % (T // BLOCK_K)) * BLOCK_K  # first group of this step within the tile
        word = _tile_words(code_ptrs + k * (BPG * T) + t0, BPG, T).to(tl.int32)  # (BLOCK_K, BLOCK_N)
        for s in tl.static_range(CPG):
            code = (word >> (s * BITS)) & ((1 << BITS) - 1)  # (BLOCK_K, BLOCK_N)
            w = tl.load(lut_rows + code).to(x_ptr.dtype.element_ty)  # (BLOCK_K, BLOCK_N) = W^T tile
            cols = k * (CPG * T) + s * T + t0 + offs_k  # (BLOCK_K,)
            xs = tl.load(x_rows + cols[None, :], mask=cols[None, :] < N, other=0.0)  # (BLOCK_M, BLOCK_K)
            acc = _dot(xs, w, acc, FP32_DOT, DOT_UPCAST)

    if HAS_SPARSE:
        acc += tl.load(sparse_ptr + offs_mc[:, None] * R + rows_c[None, :])  # (BLOCK_M, BLOCK_N) float32
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_c).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + rows[None, :]  # (BLOCK_M, BLOCK_N)
    out_mask = (offs_m[:, None] < M) & (rows[None, :] < R)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _csr_spmm_kernel(
    xt_ptr,
    rowptr_ptr,
    cols_ptr,
    resid_ptr,
    out_ptr,
    M,
    R,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SP: tl.constexpr,
):
    """Sparse residual for the GEMM path: out (M, R) float32 = x @ S^T, from xt = x^T (N, M) contiguous.

    Grid (cdiv(R, BLOCK_R), cdiv(M, BLOCK_M)). Reading x transposed makes every gather a contiguous run
    of BLOCK_M activations (one column of x), instead of BLOCK_M scattered ones.
    """
    pid_r = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    rows_c = tl.minimum(rows, R - 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_mc = tl.minimum(offs_m, M - 1)
    start = tl.load(rowptr_ptr + rows_c)  # (BLOCK_R,)
    count = tl.load(rowptr_ptr + rows_c + 1) - start  # (BLOCK_R,)
    offs_j = tl.arange(0, SP)  # (SP,)
    acc = tl.zeros((BLOCK_R, SP, BLOCK_M), dtype=tl.float32)
    max_count = tl.max(count, axis=0)
    j0 = 0
    while j0 < max_count:
        has = (j0 + offs_j)[None, :] < count[:, None]  # (BLOCK_R, SP)
        idx = start[:, None] + j0 + offs_j[None, :]  # (BLOCK_R, SP)
        c = tl.load(cols_ptr + idx, mask=has, other=0)  # masked entries: column 0 times 0.0
        v = tl.load(resid_ptr + idx, mask=has, other=0.0)
        xv = tl.load(xt_ptr + c.to(tl.int64)[:, :, None] * M + offs_mc[None, None, :])  # (BLOCK_R, SP, BLOCK_M)
        acc += xv.to(tl.float32) * v[:, :, None]
        j0 += SP
    y = tl.sum(acc, axis=1)  # (BLOCK_R, BLOCK_M)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * R + rows[:, None]  # (BLOCK_R, BLOCK_M)
    tl.store(out_ptrs, y, mask=(rows[:, None] < R) & (offs_m[None, :] < M))


@triton.jit
def _lut_dequant_kernel(
    codes_ptr,
    lut_ptr,
    out_ptr,
    R,
    N,
    NT,
    stride_o,
    BITS: tl.constexpr,
    CPG: tl.constexpr,
    BPG: tl.constexpr,
    T: tl.constexpr,
    L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Dense LUT values, out (R, N) = lut[r, code[r, c]] (no sparse part). Grid (cdiv(R, BLOCK_R), NT)."""
    pid_r = tl.program_id(0)
    k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    rows_c = tl.minimum(rows, R - 1)
    offs_t = tl.arange(0, T)  # (T,)
    code_ptrs = codes_ptr + rows_c.to(tl.int64)[:, None] * (NT * BPG * T) + k * (BPG * T) + offs_t[None, :]
    word = _tile_words(code_ptrs, BPG, T).to(tl.int32)  # (BLOCK_R, T)
    lut_rows = lut_ptr + rows_c[:, None] * L  # (BLOCK_R, 1)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_o  # (BLOCK_R, 1)
    for s in tl.static_range(CPG):
        code = (word >> (s * BITS)) & ((1 << BITS) - 1)  # (BLOCK_R, T)
        w = tl.load(lut_rows + code)  # (BLOCK_R, T)
        cols = k * (CPG * T) + s * T + offs_t  # (T,)
        mask = (rows[:, None] < R) & (cols[None, :] < N)
        tl.store(out_rows + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
