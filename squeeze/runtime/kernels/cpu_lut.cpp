// squeeze's native CPU LUT kernels: y = x @ W^T with W kept as the artifact's packed codes and per-row LUTs.
//
// Plain C ABI on raw pointers (loaded with ctypes by squeeze/runtime/kernels/cpu_build.py): no torch headers, so it
// builds in about a second with any g++ and does not depend on the torch version. Threads: OpenMP over panels
// of output rows, with the thread count the caller passes (torch's own); never over the reduction.
//
// Weight layout (docs/format.md, read as stored): row r is an LSB-first bit stream of `bits`-bit codes,
// `row_bytes` bytes apart; lut is the artifact's own (rows, 2**bits) LUT, read in place: float16 values, or
// the 8-bit LUT's uint8 levels with a float16 scale and zero per row (float32 too, for weights built so).
// Each row's LUT is expanded to float32 (16 or 8 values) when the row starts, exactly as the torch
// reference does it (level * scale, then + zero, each rounded: the library is built with -ffp-contract=off).
// Sparse part (optional): CSR rowptr int32 (rows+1); pcols int32 (nnz), each position in the PERMUTED column
// order below; resid = exact value - lut value (added by the matmul), vals = exact value (written over the
// LUT value by sq_dequant_rows).
//
// Column order: a dot product does not care about the order of its terms, so the SIMD paths decode whole
// blocks of codes into 16 lanes without interleaving them back. A block is 16 "groups" of CPG codes
// (CPG = 2 at 4 bits: one byte; CPG = 8 at 3 bits: three bytes); lane i holds group i, slot s its s-th code.
// Position s*16 + i of block k holds column k*SPAN + i*CPG + s (SPAN = 16*CPG columns). Columns after the
// last whole block keep their natural order; at 2 and 8 bits there are no blocks (the scalar path).
// x is permuted the same way once per call (sq_permute_x), and so are dequantized rows (sq_dequant_rows).
//
// The one matmul (sq_lut_matmul; sq_dense_linear_typed for dense weights): y (m, rows) = x (m, n) @ W^T
// (+ sparse residual) (+ bias) for every m >= 1, m = 1 being its smallest case. Each output y[b, r] is summed
// in ONE order that depends on neither m nor the thread count, so a row of x gets the same bits alone and in
// any batch (squeeze serve batches what squeeze run computes one row at a time):
//   V lanes (16 AVX-512, 8 AVX2; the scalar path has none): acc (V float32 lanes) = 0; for each V-wide
//   vector of positions k = 0, V, 2V, .. below nv = n - n % V: acc = fma(w[r, k..], x[b, k..], acc);
//   s = the fixed horizontal sum of acc; then s += w[r, p] * x[b, p] for p = nv .. n-1 in order (scalar:
//   every p, from s = 0); then s += resid[j] * x[b, pcol[j]] over the row's sparse entries in CSR order;
//   then y = s + bias[r].
// How: threads split the output rows into panels (8 rows when m <= the block's rows of x, else up to 32);
// a panel's rows are decoded ONCE per call into a small cache-resident float32 buffer, and every row of x
// is multiplied against it in register blocks (4 rows of x x 4 weight rows of accumulators on AVX-512,
// 2 x 4 on AVX2). Up to 4 rows of x, AVX-512 decodes 3/4-bit codes in registers as it multiplies
// (avx512::fused): the same vectors in the same order. The blocking changes which accumulators live
// together, never an accumulator's order. The bfloat16 form (AVX-512 BF16, sq_lut_matmul's bf16 = 1) is
// the same with 32-position steps of vdpbf16ps on weights and x rounded to bfloat16, nv = n - n % 32.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_codes.h"

extern "C" {

typedef struct {
    const uint8_t* packed;      // (rows, row_bytes)
    const void* lut;            // (rows, 2**bits): float32, float16 or uint8 levels, by lut_kind
    const uint16_t* lut_scale;  // float16 (rows): the 8-bit LUT's value = level * scale + zero; else NULL
    const uint16_t* lut_zero;   // float16 (rows)
    const int32_t* rowptr;  // (rows + 1) or NULL
    const int32_t* pcols;   // (nnz), permuted positions
    const float* resid;     // (nnz) exact - lut value
    const float* vals;      // (nnz) exact value
    int64_t rows;
    int64_t n;
    int64_t row_bytes;
    int32_t bits;
    int32_t lut_kind;  // SQ_LUT_F32, SQ_LUT_F16 or SQ_LUT_U8_AFFINE
} sq_weight;

enum { SQ_LUT_F32 = 0, SQ_LUT_F16 = 1, SQ_LUT_U8_AFFINE = 2 };

enum { SQ_SCALAR = 0, SQ_AVX2 = 1, SQ_AVX512 = 2 };

// element type of a dense weight (sq_dense_linear_typed): kept as the artifact stores it, converted exactly to
// float32 as it is read, so the sums are those of the float32 weight
enum { SQ_DENSE_F32 = 0, SQ_DENSE_F16 = 1, SQ_DENSE_BF16 = 2 };

}  // extern "C"

namespace {

// codes per group (CPG) and bytes per block at the widths the SIMD paths cover; 0 elsewhere (no blocks)
inline int64_t codes_per_group(int bits) { return bits == 4 ? 2 : (bits == 3 ? 8 : 0); }
inline int64_t block_bytes(int bits) { return bits == 4 ? 16 : (bits == 3 ? 48 : 0); }
inline int64_t n_blocks(int64_t n, int bits) {
    const int64_t cpg = codes_per_group(bits);
    return cpg ? n / (16 * cpg) : 0;
}

// 3 bits only: when 64 or more columns follow the last whole block, the next 64 form a HALF block of 8
// groups (24 bytes), position 8*s + i holding column half + 8*i + s (row lengths such as 576 = 4*128 + 64
// would otherwise leave 11% of the row to the scalar tail)
inline bool has_half(int64_t n, int bits) { return bits == 3 && n - n_blocks(n, bits) * 128 >= 64; }
inline int64_t half_start(int64_t n, int bits) { return n_blocks(n, bits) * 16 * codes_per_group(bits); }
inline int64_t tail_start(int64_t n, int bits) { return half_start(n, bits) + (has_half(n, bits) ? 64 : 0); }

// code of column c of an LSB-first row stream (the scalar tail and the 2/8-bit path)
inline int code_at(const uint8_t* row, int64_t c, int bits) {
    const int64_t bit = c * bits;
    uint32_t v = row[bit >> 3];
    if ((bit & 7) + bits > 8) v |= (uint32_t)row[(bit >> 3) + 1] << 8;
    return (int)((v >> (bit & 7)) & ((1u << bits) - 1));
}

// float16 bits -> float32, exactly (normal, subnormal, inf and nan)
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
        const float v = (float)mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// bfloat16 bits -> float32, exactly (the upper half of the float32's bits)
inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// dense weight element types: W::T is the stored element, W::get converts one element exactly
struct WF32 {
    typedef float T;
    static float get(const T* p) { return *p; }
};
struct WF16 {
    typedef uint16_t T;
    static float get(const T* p) { return half_to_float(*p); }
};
struct WBF16 {
    typedef uint16_t T;
    static float get(const T* p) { return bf16_to_float(*p); }
};

// row r's LUT as float32: a pointer into the weight's own LUT when it is float32, else `buf` (256 floats)
inline const float* row_lut(const sq_weight& w, int64_t r, float* buf) {
    const int64_t k = (int64_t)1 << w.bits;
    if (w.lut_kind == SQ_LUT_F32) return (const float*)w.lut + r * k;
    if (w.lut_kind == SQ_LUT_F16) {
        const uint16_t* src = (const uint16_t*)w.lut + r * k;
        for (int64_t i = 0; i < k; ++i) buf[i] = half_to_float(src[i]);
    } else {
        const uint8_t* src = (const uint8_t*)w.lut + r * k;
        const float scale = half_to_float(w.lut_scale[r]), zero = half_to_float(w.lut_zero[r]);
        for (int64_t i = 0; i < k; ++i) buf[i] = (float)src[i] * scale + zero;  // two roundings, as torch
    }
    return buf;
}

// the columns after the last whole (half) block; `sparse`: the sparse part's exact values written over the LUT
// values (sq_dequant_rows), else left out (the matmul adds them as a residual after the dense sum)
inline void dequant_tail(const sq_weight& w, int64_t r, const float* lut, float* out, int64_t first_tail, bool sparse) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    for (int64_t c = first_tail; c < w.n; ++c) out[c] = lut[code_at(row, c, w.bits)];
    if (sparse && w.rowptr)
        for (int32_t j = w.rowptr[r]; j < w.rowptr[r + 1]; ++j) out[w.pcols[j]] = w.vals[j];
}

// ---------------------------------------------------------------------------------------------------------
// Portable scalar path: the same blocks in the same order, one lane at a time.
namespace scalar {

inline uint32_t word3(const uint8_t* p) { return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16; }

// the half block (24 bytes at p) dequantized into out
inline void half3_dequant(const uint8_t* p, const float* lut, float* out) {
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 8; ++k) out[8 * k + i] = lut[(word3(p + 3 * i) >> (3 * k)) & 7];
}

void dequant_row(const sq_weight& w, int64_t r, float* out, bool sparse) {
    const int64_t nb = n_blocks(w.n, w.bits);
    const uint8_t* row = w.packed + r * w.row_bytes;
    float lut_buf[256];
    const float* lut = row_lut(w, r, lut_buf);
    for (int64_t k = 0; k < nb; ++k) {
        if (w.bits == 4) {
            for (int i = 0; i < 16; ++i) {
                out[32 * k + i] = lut[row[16 * k + i] & 15];
                out[32 * k + 16 + i] = lut[row[16 * k + i] >> 4];
            }
        } else {
            const uint8_t* p = row + 48 * k;
            for (int i = 0; i < 16; ++i) {
                const uint32_t word = word3(p + 3 * i);
                for (int s = 0; s < 8; ++s) out[128 * k + 16 * s + i] = lut[(word >> (3 * s)) & 7];
            }
        }
    }
    if (has_half(w.n, w.bits)) half3_dequant(row + 48 * nb, lut, out + half_start(w.n, w.bits));
    dequant_tail(w, r, lut, out, tail_start(w.n, w.bits), sparse);
}

// a dense weight's row (n elements of W::T) as float32, exactly
template <class W>
void convert_row(const void* src, int64_t n, float* out) {
    const typename W::T* s = (const typename W::T*)src;
    for (int64_t k = 0; k < n; ++k) out[k] = W::get(s + k);
}
}  // namespace scalar

// ---------------------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes; a block is done as two halves of 8 groups. 16-entry LUT: two permutes and a blend.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// row_lut with the common case (a float16 LUT at 3 or 4 bits) converted by F16C: exact, as the scalar one
inline const float* row_lut_f16c(const sq_weight& w, int64_t r, float* buf) {
    if (w.lut_kind != SQ_LUT_F16 || (w.bits != 3 && w.bits != 4)) return row_lut(w, r, buf);
    const uint16_t* src = (const uint16_t*)w.lut + (r << w.bits);
    _mm256_storeu_ps(buf, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)src)));
    if (w.bits == 4) _mm256_storeu_ps(buf + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 8))));
    return buf;
}

inline __m256 lookup16(__m256 lut_lo, __m256 lut_hi, __m256i idx) {
    const __m256 a = _mm256_permutevar8x32_ps(lut_lo, idx), b = _mm256_permutevar8x32_ps(lut_hi, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));  // bit 3 -> sign bit
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

using sq_codes::avx2::words3;  // 8 groups of three bytes -> 8 dwords (cpu_codes.h)

// the 3-bit half block (24 bytes at p) dequantized into out
inline void half3_dequant(const uint8_t* p, const float* lut, float* out) {
    const __m256 l8 = _mm256_loadu_ps(lut);
    const __m256i m = _mm256_set1_epi32(7);
    __m256i words = words3(p);
    for (int s = 0; s < 8; ++s, words = _mm256_srli_epi32(words, 3))
        _mm256_storeu_ps(out + 8 * s, _mm256_permutevar8x32_ps(l8, _mm256_and_si256(words, m)));
}

// visit every block of row r: f(position, 8 weights) in the permuted order (the dequantize path)
template <class F>
inline void decode_blocks(const sq_weight& w, int64_t r, const float* lut, F&& f) {
    const int64_t nb = n_blocks(w.n, w.bits);
    const uint8_t* row = w.packed + r * w.row_bytes;
    if (w.bits == 4) {
        const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
        const __m256i m = _mm256_set1_epi32(15);
        for (int64_t k = 0; k < nb; ++k)
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + 16 * k + 8 * h)));
                f(32 * k + 8 * h, lookup16(lo, hi, _mm256_and_si256(v, m)));
                f(32 * k + 16 + 8 * h, lookup16(lo, hi, _mm256_srli_epi32(v, 4)));
            }
    } else if (w.bits == 3) {
        const __m256 l8 = _mm256_loadu_ps(lut);
        const __m256i m = _mm256_set1_epi32(7);
        for (int64_t k = 0; k < nb; ++k)
            for (int h = 0; h < 2; ++h) {
                __m256i words = words3(row + 48 * k + 24 * h);
                for (int s = 0; s < 8; ++s) {
                    f(128 * k + 16 * s + 8 * h, _mm256_permutevar8x32_ps(l8, _mm256_and_si256(words, m)));
                    words = _mm256_srli_epi32(words, 3);
                }
            }
    }
}

inline void dequant_half_and_tail(const sq_weight& w, int64_t r, const float* lut, float* out, bool sparse) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    if (has_half(w.n, w.bits)) half3_dequant(row + 48 * n_blocks(w.n, w.bits), lut, out + half_start(w.n, w.bits));
    dequant_tail(w, r, lut, out, tail_start(w.n, w.bits), sparse);
}

void dequant_row(const sq_weight& w, int64_t r, float* out, bool sparse) {
    float lut_buf[256];
    const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
    decode_blocks(w, r, lut, [&](int64_t pos, __m256 wv) { _mm256_storeu_ps(out + pos, wv); });
    dequant_half_and_tail(w, r, lut, out, sparse);
}

// 8 weights from p as float32, exactly (F16C for float16, a shift for bfloat16)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <class W> inline __m256 load8w(const typename W::T* p);
template <> inline __m256 load8w<WF32>(const float* p) { return load8(p); }
template <> inline __m256 load8w<WF16>(const uint16_t* p) { return load8_f16(p); }
template <> inline __m256 load8w<WBF16>(const uint16_t* p) { return load8_bf16(p); }


template <class W>
void convert_row(const void* src, int64_t n, float* out) {
    const typename W::T* s = (const typename W::T*)src;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, load8w<W>(s + k));
    for (; k < n; ++k) out[k] = W::get(s + k);
}

// The matmul's block (header comment): MB rows of x (ldx apart) times the 4 weight rows wr[0..3], one 8-lane
// accumulator per pair over positions [0, nv), then hsum: out[4 * b + i]. 2 x 4 accumulators, the 4 weight
// vectors and one of x fit the 16 registers.
template <int MB>
void block(const float* const* wr, const float* x, int64_t ldx, int64_t nv, float* out) {
    __m256 acc[MB][4];
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[b][i] = _mm256_setzero_ps();
    const float *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    for (int64_t k = 0; k < nv; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k),
                     v3 = _mm256_loadu_ps(w3 + k);
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m256 xv = _mm256_loadu_ps(x + b * ldx + k);
            acc[b][0] = _mm256_fmadd_ps(v0, xv, acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(v1, xv, acc[b][1]);
            acc[b][2] = _mm256_fmadd_ps(v2, xv, acc[b][2]);
            acc[b][3] = _mm256_fmadd_ps(v3, xv, acc[b][3]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) out[4 * b + i] = hsum(acc[b][i]);
}

}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VBMI): 16 lanes, one whole block at a time; the LUT lives in one register and one permute
// looks up 16 weights.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,fma,f16c")
namespace avx512 {

using sq_codes::avx512::words3;  // 16 groups of three bytes -> 16 dwords (cpu_codes.h)

// visit every block of row r: f(position, 16 weights) in the permuted order (the dequantize path)
template <class F>
inline void decode_blocks(const sq_weight& w, int64_t r, const float* lut, F&& f) {
    const int64_t nb = n_blocks(w.n, w.bits);
    const uint8_t* row = w.packed + r * w.row_bytes;
    if (w.bits == 4) {
        const __m512 l16 = _mm512_loadu_ps(lut);
        const __m512i m = _mm512_set1_epi32(15);
        for (int64_t k = 0; k < nb; ++k) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * k)));
            f(32 * k, _mm512_permutexvar_ps(_mm512_and_si512(v, m), l16));
            f(32 * k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), l16));
        }
    } else if (w.bits == 3) {
        const __m512 l8 = _mm512_maskz_loadu_ps(0xFF, lut);
        const __m512i m = _mm512_set1_epi32(7);
        for (int64_t k = 0; k < nb; ++k) {
            __m512i words = words3(row + 48 * k);
            for (int s = 0; s < 8; ++s) {
                f(128 * k + 16 * s, _mm512_permutexvar_ps(_mm512_and_si512(words, m), l8));
                words = _mm512_srli_epi32(words, 3);
            }
        }
    }
}

void dequant_row(const sq_weight& w, int64_t r, float* out, bool sparse) {
    float lut_buf[256];
    const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
    decode_blocks(w, r, lut, [&](int64_t pos, __m512 wv) { _mm512_storeu_ps(out + pos, wv); });
    avx2::dequant_half_and_tail(w, r, lut, out, sparse);
}

// 16 weights from p as float32, exactly
template <class W> inline __m512 load16w(const typename W::T* p);
template <> inline __m512 load16w<WF32>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16w<WF16>(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
template <> inline __m512 load16w<WBF16>(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}


template <class W>
void convert_row(const void* src, int64_t n, float* out) {
    const typename W::T* s = (const typename W::T*)src;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) _mm512_storeu_ps(out + k, load16w<W>(s + k));
    for (; k < n; ++k) out[k] = W::get(s + k);
}

// avx2::block with 16 lanes and up to 4 rows of x: 16 accumulators, 4 weight vectors, one of x
template <int MB>
void block(const float* const* wr, const float* x, int64_t ldx, int64_t nv, float* out) {
    __m512 acc[MB][4];
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[b][i] = _mm512_setzero_ps();
    const float *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    for (int64_t k = 0; k < nv; k += 16) {
        const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k), v2 = _mm512_loadu_ps(w2 + k),
                     v3 = _mm512_loadu_ps(w3 + k);
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m512 xv = _mm512_loadu_ps(x + b * ldx + k);
            acc[b][0] = _mm512_fmadd_ps(v0, xv, acc[b][0]);
            acc[b][1] = _mm512_fmadd_ps(v1, xv, acc[b][1]);
            acc[b][2] = _mm512_fmadd_ps(v2, xv, acc[b][2]);
            acc[b][3] = _mm512_fmadd_ps(v3, xv, acc[b][3]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) out[4 * b + i] = _mm512_reduce_add_ps(acc[b][i]);
}


// block() for the RB LUT rows rows[0 .. RB-1] (RB = 4, or 8 for one row of x) decoded in registers as they are used, no buffer (few rows of x:
// the decode is then most of the work): the same weight vectors meet the same x vectors in the same order,
// so the same bits. rem[i]: row i's positions [half, n) decoded (the 3-bit half block and the tail).
template <int MB, int RB>
void fused(const sq_weight& w, const uint8_t* const* rows, const float* const* luts, const float* x, int64_t ldx,
           int64_t nv, const float* const* rem, float* out) {
    __m512 acc[MB][RB];
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_setzero_ps();
    const int64_t nb = n_blocks(w.n, w.bits), half = half_start(w.n, w.bits);
    __m512 l[RB];
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) l[i] = w.bits == 4 ? _mm512_loadu_ps(luts[i]) : _mm512_maskz_loadu_ps(0xFF, luts[i]);
    if (w.bits == 4) {
        const __m512i m = _mm512_set1_epi32(15);
        for (int64_t k = 0; k < nb; ++k) {
            __m512i v[RB];
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) v[i] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rows[i] + 16 * k)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                __m512 wv[RB];
#pragma GCC unroll 8
                for (int i = 0; i < RB; ++i)
                    wv[i] = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(v[i], 4) : _mm512_and_si512(v[i], m), l[i]);
#pragma GCC unroll 4
                for (int b = 0; b < MB; ++b) {
                    const __m512 xv = _mm512_loadu_ps(x + b * ldx + 32 * k + 16 * h);
#pragma GCC unroll 8
                    for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_fmadd_ps(wv[i], xv, acc[b][i]);
                }
            }
        }
    } else if (w.bits == 3) {
        const __m512i m = _mm512_set1_epi32(7);
        for (int64_t k = 0; k < nb; ++k) {
            __m512i words[RB];
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) words[i] = words3(rows[i] + 48 * k);
#pragma GCC unroll 8
            for (int s = 0; s < 8; ++s) {
                __m512 wv[RB];
#pragma GCC unroll 8
                for (int i = 0; i < RB; ++i) {
                    wv[i] = _mm512_permutexvar_ps(_mm512_and_si512(words[i], m), l[i]);
                    words[i] = _mm512_srli_epi32(words[i], 3);
                }
#pragma GCC unroll 4
                for (int b = 0; b < MB; ++b) {
                    const __m512 xv = _mm512_loadu_ps(x + b * ldx + 128 * k + 16 * s);
#pragma GCC unroll 8
                    for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_fmadd_ps(wv[i], xv, acc[b][i]);
                }
            }
        }
    }
    for (int64_t k = half; k < nv; k += 16) {
        __m512 wv[RB];
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) wv[i] = _mm512_loadu_ps(rem[i] + (k - half));
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m512 xv = _mm512_loadu_ps(x + b * ldx + k);
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_fmadd_ps(wv[i], xv, acc[b][i]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) out[RB * b + i] = _mm512_reduce_add_ps(acc[b][i]);
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------------------
// The bfloat16 form (AVX-512 BF16, vdpbf16ps): weights and activations rounded to bfloat16 (nearest even),
// each lane summing pairs of products into float32, 32 positions per instruction.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,fma,f16c")
namespace bf16 {

using sq_codes::avx512::words3;

// the first n - n % 32 of n float32 values rounded to bfloat16 (the rest are the float32 tail's)
void convert(const float* src, int64_t n, uint16_t* out) {
    for (int64_t k = 0; k + 32 <= n; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
        _mm512_storeu_si512(out + k, (__m512i)v);
    }
}

// avx512::block for the bfloat16 form: one 16-lane float32 accumulator per pair, 32 positions per step
template <int MB>
void block(const uint16_t* const* wr, const uint16_t* x, int64_t ldx, int64_t nv, float* out) {
    __m512 acc[MB][4];
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[b][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nv; k += 32) {
        __m512bh v[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) v[i] = (__m512bh)_mm512_loadu_si512(wr[i] + k);
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + k);
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], v[i], xv);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) out[4 * b + i] = _mm512_reduce_add_ps(acc[b][i]);
}

// block() for the RB LUT rows rows[0 .. RB-1] decoded in registers straight to bfloat16 (vpermw on each row's
// LUT rounded as convert() rounds it): the same vectors in the same order as the buffered form, so the same
// bits (avx512::fused for the float32 form). rem[i]: row i's positions [half, nv) as bfloat16.
template <int MB, int RB>
void fused(const sq_weight& w, const uint8_t* const* rows, const float* const* luts, const uint16_t* x, int64_t ldx,
           int64_t nv, const uint16_t* const* rem, float* out) {
    __m512 acc[MB][RB];
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_setzero_ps();
    const int64_t nb = n_blocks(w.n, w.bits), half = half_start(w.n, w.bits);
    __m512i t[RB];
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
        const __m512 l = w.bits == 4 ? _mm512_loadu_ps(luts[i]) : _mm512_maskz_loadu_ps(0xFF, luts[i]);
        t[i] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(l));
    }
    if (w.bits == 4) {
        const __m128i m4 = _mm_set1_epi8(15);
        for (int64_t k = 0; k < nb; ++k) {
            __m512bh wv[RB];
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(rows[i] + 16 * k));
                const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
                wv[i] = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nib), t[i]);
            }
#pragma GCC unroll 4
            for (int b = 0; b < MB; ++b) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + 32 * k);
#pragma GCC unroll 8
                for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wv[i], xv);
            }
        }
    } else if (w.bits == 3) {
        const __m512i m = _mm512_set1_epi32(7);
        for (int64_t k = 0; k < nb; ++k) {
            __m512i words[RB];
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) words[i] = words3(rows[i] + 48 * k);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {  // codes 2j and 2j + 1 of each group: positions 32j .. 32j + 31
                __m512bh wv[RB];
#pragma GCC unroll 8
                for (int i = 0; i < RB; ++i) {
                    const __m256i c0 = _mm512_cvtepi32_epi16(_mm512_and_si512(words[i], m));
                    const __m256i c1 = _mm512_cvtepi32_epi16(_mm512_and_si512(_mm512_srli_epi32(words[i], 3), m));
                    words[i] = _mm512_srli_epi32(words[i], 6);
                    wv[i] = (__m512bh)_mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1), t[i]);
                }
#pragma GCC unroll 4
                for (int b = 0; b < MB; ++b) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + 128 * k + 32 * j);
#pragma GCC unroll 8
                    for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wv[i], xv);
                }
            }
        }
    }
    for (int64_t k = half; k < nv; k += 32) {
        __m512bh wv[RB];
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(rem[i] + (k - half));
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + k);
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wv[i], xv);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < MB; ++b)
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) out[RB * b + i] = _mm512_reduce_add_ps(acc[b][i]);
}

typedef void (*block_fn)(const uint16_t* const*, const uint16_t*, int64_t, int64_t, float*);
block_fn block_for(int64_t mb) {
    static const block_fn fns[4] = {block<1>, block<2>, block<3>, block<4>};
    return fns[mb - 1];
}

}  // namespace bf16
#pragma GCC pop_options

// The one matmul (header comment).
typedef void (*dequant_fn)(const sq_weight&, int64_t, float*, bool);
typedef void (*block_fn)(const float* const*, const float*, int64_t, int64_t, float*);
typedef void (*convert_fn)(const void*, int64_t, float*);

dequant_fn dequant_for(int isa) {
    if (isa == SQ_AVX512) return avx512::dequant_row;
    if (isa == SQ_AVX2) return avx2::dequant_row;
    return scalar::dequant_row;
}

// the block for mb rows of x (mb <= max_block_rows(isa)); NULL on the scalar path (no vector part)
block_fn block_for(int isa, int64_t mb) {
    if (isa == SQ_AVX512) {
        static const block_fn fns[4] = {avx512::block<1>, avx512::block<2>, avx512::block<3>, avx512::block<4>};
        return fns[mb - 1];
    }
    if (isa == SQ_AVX2) return mb == 1 ? avx2::block<1> : avx2::block<2>;
    return nullptr;
}
inline int64_t max_block_rows(int isa) { return isa == SQ_AVX512 ? 4 : (isa == SQ_AVX2 ? 2 : 8); }
inline int64_t lanes(int isa) { return isa == SQ_AVX512 ? 16 : (isa == SQ_AVX2 ? 8 : 0); }

template <class W>
convert_fn convert_for(int isa) {
    if (isa == SQ_AVX512) return avx512::convert_row<W>;
    if (isa == SQ_AVX2) return avx2::convert_row<W>;
    return scalar::convert_row<W>;
}

inline int64_t dense_elem_bytes(int32_t dtype) { return dtype == SQ_DENSE_F32 ? 4 : 2; }

struct Matmul {
    const sq_weight* lut;  // a LUT weight, its rows decoded in the permuted column order; or NULL:
    const void* dense;     // a dense (rows, n) weight of element type dtype
    int32_t dtype;
    int64_t rows, n, m;
    const float* x;  // (m, n): permuted (sq_permute_x) for a LUT weight
    float* y;        // (m, rows)
    const float* bias;
    int isa;
    const uint16_t* xh;  // (m, n) bfloat16: the bfloat16 form (LUT weights on AVX-512 BF16), else NULL
};

// row r of the weight as float32: a pointer into a float32 dense weight, else decoded into buf (n floats)
inline const float* weight_row(const Matmul& c, int64_t r, float* buf) {
    if (c.lut) {
        dequant_for(c.isa)(*c.lut, r, buf, false);
        return buf;
    }
    if (c.dtype == SQ_DENSE_F32) return (const float*)c.dense + r * c.n;
    const convert_fn fn = c.dtype == SQ_DENSE_F16 ? convert_for<WF16>(c.isa) : convert_for<WBF16>(c.isa);
    fn((const uint16_t*)c.dense + r * c.n, c.n, buf);
    return buf;
}

// y[b, r] from the vector part's sum s (header comment): the scalar remainder (wt: the row's weights from
// position nv on), the sparse residual, the bias
inline float finish(const Matmul& c, int64_t r, float s, const float* wt, const float* x, int64_t nv) {
    for (int64_t k = nv; k < c.n; ++k) s += wt[k - nv] * x[k];
    const sq_weight* lw = c.lut;
    if (lw && lw->rowptr)
        for (int32_t j = lw->rowptr[r]; j < lw->rowptr[r + 1]; ++j) s += lw->resid[j] * x[lw->pcols[j]];
    if (c.bias) s = s + c.bias[r];
    return s;
}

constexpr int64_t PANEL_MAX = 32;
// weight rows per panel: 8 when every row of x fits one block (the buffer stays in L1), else as many as fit
// in about 256 KiB (L2), a multiple of 4 up to PANEL_MAX. Never changes a sum's order.
inline int64_t panel_rows(const Matmul& c) {
    if (c.m <= max_block_rows(c.isa)) return 8;
    const int64_t fit = (256 << 10) / (4 * (c.n > 16 ? c.n : 16));
    return fit >= PANEL_MAX ? PANEL_MAX : (fit < 4 ? 4 : fit & ~(int64_t)3);
}

//: rows of x up to which AVX-512 decodes 3- and 4-bit codes in registers as it multiplies (avx512::fused)
constexpr int64_t FUSED_MAX_ROWS = 4;

inline bool fused_applies(const Matmul& c) {
    return c.lut && c.isa == SQ_AVX512 && (c.lut->bits == 3 || c.lut->bits == 4) && c.m <= FUSED_MAX_ROWS;
}

// positions [half, n) of LUT row r (the 3-bit half block, then the tail) into out[0 .. n - half)
inline void dequant_rem(const sq_weight& w, int64_t r, const float* lut, float* out) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    const int64_t half = half_start(w.n, w.bits), tail = tail_start(w.n, w.bits);
    if (tail != half) avx2::half3_dequant(row + 48 * n_blocks(w.n, w.bits), lut, out);
    for (int64_t c = tail; c < w.n; ++c) out[c - half] = lut[code_at(row, c, w.bits)];
}

// fused_panel's groups of RB rows (see avx512::fused; HALF: the bfloat16 form, bf16::fused)
template <int RB, bool HALF>
void fused_groups(const Matmul& c, int64_t r0, int64_t r1) {
    const sq_weight& w = *c.lut;
    const int64_t n = c.n, nv = HALF ? n - n % 32 : n - n % 16, half = half_start(n, w.bits);
    alignas(64) float lutb[RB][256], remb[RB][256];  // the remainder: at most 64 + 127 positions
    alignas(64) uint16_t remh[RB][256];
    for (int64_t g = r0; g < r1; g += RB) {
        const int64_t live = r1 - g < RB ? r1 - g : RB;
        const uint8_t* rows[RB];
        const float* luts[RB];
        const float* rem[RB];
        const uint16_t* remx[RB];
        for (int64_t i = 0; i < RB; ++i) {
            if (i >= live) {  // a partial group repeats its last row (computed, never stored)
                rows[i] = rows[live - 1], luts[i] = luts[live - 1], rem[i] = rem[live - 1], remx[i] = remx[live - 1];
                continue;
            }
            rows[i] = w.packed + (g + i) * w.row_bytes;
            luts[i] = avx2::row_lut_f16c(w, g + i, lutb[i]);
            dequant_rem(w, g + i, luts[i], remb[i]);
            rem[i] = remb[i];
            if (HALF) bf16::convert(remb[i], nv - half, remh[i]);
            remx[i] = remh[i];
        }
        float sums[4 * RB];
        if (HALF) {
            switch (c.m) {
                case 1: bf16::fused<1, RB>(w, rows, luts, c.xh, n, nv, remx, sums); break;
                case 2: bf16::fused<2, RB>(w, rows, luts, c.xh, n, nv, remx, sums); break;
                case 3: bf16::fused<3, RB>(w, rows, luts, c.xh, n, nv, remx, sums); break;
                default: bf16::fused<4, RB>(w, rows, luts, c.xh, n, nv, remx, sums); break;
            }
        } else {
            switch (c.m) {
                case 1: avx512::fused<1, RB>(w, rows, luts, c.x, n, nv, rem, sums); break;
                case 2: avx512::fused<2, RB>(w, rows, luts, c.x, n, nv, rem, sums); break;
                case 3: avx512::fused<3, RB>(w, rows, luts, c.x, n, nv, rem, sums); break;
                default: avx512::fused<4, RB>(w, rows, luts, c.x, n, nv, rem, sums); break;
            }
        }
        for (int64_t b = 0; b < c.m; ++b)
            for (int64_t i = 0; i < live; ++i)
                c.y[b * c.rows + g + i] = finish(c, g + i, sums[RB * b + i], rem[i] + (nv - half), c.x + b * n, nv);
    }
}

// panel() for fused_applies(c): 8 rows at a time for one row of x (more independent sums), else 4
void fused_panel(const Matmul& c, int64_t r0, int64_t r1) {
    if (c.xh)
        c.m == 1 ? fused_groups<8, true>(c, r0, r1) : fused_groups<4, true>(c, r0, r1);
    else
        c.m == 1 ? fused_groups<8, false>(c, r0, r1) : fused_groups<4, false>(c, r0, r1);
}

// output rows [r0, r1) (at most PANEL_MAX) for every row of x
void panel_bf16(const Matmul& c, int64_t r0, int64_t r1);

void panel(const Matmul& c, int64_t r0, int64_t r1) {
    if (fused_applies(c)) return fused_panel(c, r0, r1);
    if (c.xh) return panel_bf16(c, r0, r1);
    const int64_t n = c.n, ld = (n + 15) & ~(int64_t)15, p = r1 - r0, mbx = max_block_rows(c.isa);
    const int64_t nv = lanes(c.isa) ? n - n % lanes(c.isa) : 0;
    static thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < PANEL_MAX * ld) buf.resize((size_t)(PANEL_MAX * ld));
    const float* wr[PANEL_MAX + 3];
    for (int64_t i = 0; i < p; ++i) wr[i] = weight_row(c, r0 + i, buf.data() + i * ld);
    for (int64_t i = p; i < p + 3; ++i) wr[i] = wr[p - 1];  // a partial group of 4 repeats its last row
    float sums[32];
    for (int64_t b0 = 0; b0 < c.m; b0 += mbx) {
        const int64_t mb = c.m - b0 < mbx ? c.m - b0 : mbx;
        const float* xb = c.x + b0 * n;
        const block_fn fn = block_for(c.isa, mb);
        for (int64_t i0 = 0; i0 < p; i0 += 4) {
            if (fn)
                fn(wr + i0, xb, n, nv, sums);
            else
                memset(sums, 0, sizeof sums);
            const int64_t live = p - i0 < 4 ? p - i0 : 4;
            for (int64_t b = 0; b < mb; ++b)
                for (int64_t i = 0; i < live; ++i)
                    c.y[(b0 + b) * c.rows + r0 + i0 + i] = finish(c, r0 + i0 + i, sums[4 * b + i], wr[i0 + i] + nv, xb + b * n, nv);
        }
    }
}

// panel() for the bfloat16 form: positions below nv = n - n % 32 by bf16::block, the rest in float32 (finish)
void panel_bf16(const Matmul& c, int64_t r0, int64_t r1) {
    const int64_t n = c.n, ld = (n + 31) & ~(int64_t)31, p = r1 - r0, nv = n - n % 32;
    static thread_local std::vector<float> buf;
    static thread_local std::vector<uint16_t> hbuf;
    if ((int64_t)buf.size() < PANEL_MAX * ld) {
        buf.resize((size_t)(PANEL_MAX * ld));
        hbuf.resize((size_t)(PANEL_MAX * ld));
    }
    const float* wr[PANEL_MAX + 3];
    const uint16_t* wh[PANEL_MAX + 3];
    for (int64_t i = 0; i < p; ++i) {
        wr[i] = weight_row(c, r0 + i, buf.data() + i * ld);
        bf16::convert(wr[i], n, hbuf.data() + i * ld);
        wh[i] = hbuf.data() + i * ld;
    }
    for (int64_t i = p; i < p + 3; ++i) wr[i] = wr[p - 1], wh[i] = wh[p - 1];
    float sums[16];
    for (int64_t b0 = 0; b0 < c.m; b0 += 4) {
        const int64_t mb = c.m - b0 < 4 ? c.m - b0 : 4;
        const bf16::block_fn fn = bf16::block_for(mb);
        for (int64_t i0 = 0; i0 < p; i0 += 4) {
            fn(wh + i0, c.xh + b0 * n, n, nv, sums);
            const int64_t live = p - i0 < 4 ? p - i0 : 4;
            for (int64_t b = 0; b < mb; ++b)
                for (int64_t i = 0; i < live; ++i)
                    c.y[(b0 + b) * c.rows + r0 + i0 + i] =
                        finish(c, r0 + i0 + i, sums[4 * b + i], wr[i0 + i] + nv, c.x + (b0 + b) * n, nv);
        }
    }
}

void run(const Matmul& c, int threads) {
    const int64_t p = panel_rows(c), tasks = (c.rows + p - 1) / p;
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1 && threads > 1)
    for (int64_t t = 0; t < tasks; ++t) panel(c, t * p, (t + 1) * p < c.rows ? (t + 1) * p : c.rows);
}
}  // namespace

extern "C" {

// 1 when this CPU runs `isa` (the caller asks before choosing one)
int sq_isa_supported(int isa) {
    __builtin_cpu_init();
    if (isa == SQ_SCALAR) return 1;
    if (isa == SQ_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == SQ_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("avx512vnni") &&  // the int8 kernels' dot product (cpu_w8.cpp)
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return 0;
}

// x float32 (batch, n) -> xp float32 (batch, n) in the kernel's column order for `bits`
void sq_permute_x(const float* x, float* xp, int64_t batch, int64_t n, int32_t bits) {
    const int64_t cpg = codes_per_group(bits), nb = n_blocks(n, bits), span = 16 * cpg;
    for (int64_t b = 0; b < batch; ++b) {
        const float* xr = x + b * n;
        float* out = xp + b * n;
        for (int64_t k = 0; k < nb; ++k)
            for (int64_t i = 0; i < 16; ++i)
                for (int64_t s = 0; s < cpg; ++s) out[k * span + s * 16 + i] = xr[k * span + i * cpg + s];
        const int64_t half = half_start(n, bits), tail = tail_start(n, bits);
        for (int64_t i = 0; i < 8 && tail != half; ++i)
            for (int64_t s = 0; s < 8; ++s) out[half + 8 * s + i] = xr[half + 8 * i + s];
        memcpy(out + tail, xr + tail, (size_t)(n - tail) * sizeof(float));
    }
}


// 1 when this CPU runs the bfloat16 form (AVX-512 BF16 besides sq_isa_supported(SQ_AVX512))
int sq_bf16_supported(void) {
    __builtin_cpu_init();
    return sq_isa_supported(SQ_AVX512) && __builtin_cpu_supports("avx512bf16");
}

// y float32 (m, rows) = x (m, n) float32 @ W^T + sparse residual + bias (float32 (rows) or NULL): the one
// matmul (header comment) for every m; x in natural order, permuted into a scratch buffer of the calling thread.
// bf16 = 1 (with isa SQ_AVX512 where sq_bf16_supported()): the bfloat16 form, else float32
void sq_lut_matmul(const sq_weight* w, const float* x, int64_t m, float* y, const float* bias, int32_t isa,
                   int32_t threads, int32_t bf16) {
    if (m <= 0 || w->rows <= 0) return;
    static thread_local std::vector<float> xp;
    static thread_local std::vector<uint16_t> xh;
    if ((int64_t)xp.size() < m * w->n) xp.resize((size_t)(m * w->n));
    sq_permute_x(x, xp.data(), m, w->n, w->bits);
    const bool half = bf16 && isa == SQ_AVX512;
    if (half) {
        if ((int64_t)xh.size() < m * w->n) xh.resize((size_t)(m * w->n));
        for (int64_t b = 0; b < m; ++b) bf16::convert(xp.data() + b * w->n, w->n, xh.data() + b * w->n);
    }
    const Matmul c{w, nullptr, 0, w->rows, w->n, m, xp.data(), y, bias, isa, half ? xh.data() : nullptr};
    // waking the other threads costs microseconds: small products run on the calling thread
    run(c, w->rows * w->row_bytes * (m < 8 ? m : 8) < (64 << 10) ? 1 : threads);
}

// rows [r0, r1) dequantized into out float32 (r1 - r0, n), in the kernel's column order, sparse values in place
void sq_dequant_rows(const sq_weight* w, int64_t r0, int64_t r1, float* out, int32_t isa, int32_t threads) {
    const sq_weight wt = *w;
    const dequant_fn fn = dequant_for(isa);
#pragma omp parallel for schedule(static) num_threads(threads) if (r1 - r0 > 4)
    for (int64_t r = r0; r < r1; ++r) fn(wt, r, out + (r - r0) * wt.n, true);
}

// y float32 (batch, rows) = x (batch, n) @ w^T + bias for a dense weight w (rows, n) of element type `dtype`
// (SQ_DENSE_F32, _F16 or _BF16, each element converted exactly to float32 as it is read: the same bits as the
// weight upcast to float32, kept in memory as the artifact stores it), by the one matmul (header comment):
// a row's result is the same at every batch size
void sq_dense_linear_typed(const void* w, int32_t dtype, int64_t rows, int64_t n, const float* x, int64_t batch,
                           float* y, const float* bias, int32_t isa, int32_t threads) {
    if (batch <= 0 || rows <= 0) return;
    const Matmul c{nullptr, w, dtype, rows, n, batch, x, y, bias, isa, nullptr};
    run(c, rows * n * dense_elem_bytes(dtype) < (256 << 10) ? 1 : threads);
}

// sq_dense_linear_typed for a float32 weight
void sq_dense_linear(const float* w, int64_t rows, int64_t n, const float* x, int64_t batch, float* y,
                     const float* bias, int32_t isa, int32_t threads) {
    sq_dense_linear_typed(w, SQ_DENSE_F32, rows, n, x, batch, y, bias, isa, threads);
}

}  // extern "C"
