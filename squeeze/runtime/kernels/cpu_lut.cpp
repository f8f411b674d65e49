// squeeze's native CPU LUT kernels: y = x @ W^T with W kept as the artifact's packed codes and per-row LUTs.
//
// Plain C ABI on raw pointers (loaded with ctypes by squeeze/runtime/kernels/cpu_build.py): no torch headers, so it
// builds in about a second with any g++ and does not depend on the torch version. Threads: OpenMP over
// output rows, with the thread count the caller passes (torch's own). The GEMM of the prefill path is torch's.
//
// Weight layout (docs/format.md, read as stored): row r is an LSB-first bit stream of `bits`-bit codes,
// `row_bytes` bytes apart; lut is the artifact's own (rows, 2**bits) LUT, read in place: float16 values, or
// the 8-bit LUT's uint8 levels with a float16 scale and zero per row (float32 too, for weights built so).
// Each row's LUT is expanded to float32 (16 or 8 values) when the row starts, exactly as the torch
// reference does it (level * scale, then + zero, each rounded: the library is built with -ffp-contract=off). Sparse part (optional): CSR rowptr int32 (rows+1); pcols int32 (nnz), each position in the
// PERMUTED column order below; resid = exact value - lut value (for the GEMV), vals = exact value (for the
// dequantized tiles, which the sparse values replace).
//
// Column order: a dot product does not care about the order of its terms, so the SIMD paths decode whole
// blocks of codes into 16 lanes without interleaving them back. A block is 16 "groups" of CPG codes
// (CPG = 2 at 4 bits: one byte; CPG = 8 at 3 bits: three bytes); lane i holds group i, slot s its s-th code.
// Position s*16 + i of block k holds column k*SPAN + i*CPG + s (SPAN = 16*CPG columns). Columns after the
// last whole block keep their natural order; at 2 and 8 bits there are no blocks (the scalar path).
// x is permuted the same way once per call (sq_permute_x), and so are dequantized rows (sq_dequant_rows).

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

// the columns after the last whole block, plus the sparse residual: the part every ISA does in scalar code
inline float tail_and_sparse(const sq_weight& w, int64_t r, const float* lut, const float* xp, int64_t first_tail) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    float s = 0.f;
    for (int64_t c = first_tail; c < w.n; ++c) s += lut[code_at(row, c, w.bits)] * xp[c];
    if (w.rowptr)
        for (int32_t j = w.rowptr[r]; j < w.rowptr[r + 1]; ++j) s += w.resid[j] * xp[w.pcols[j]];
    return s;
}

inline void tail_and_sparse_dequant(const sq_weight& w, int64_t r, const float* lut, float* out,
                                    int64_t first_tail) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    for (int64_t c = first_tail; c < w.n; ++c) out[c] = lut[code_at(row, c, w.bits)];
    if (w.rowptr)
        for (int32_t j = w.rowptr[r]; j < w.rowptr[r + 1]; ++j) out[w.pcols[j]] = w.vals[j];
}

// ---------------------------------------------------------------------------------------------------------
// Portable scalar path: the same blocks in the same order, one lane at a time.
namespace scalar {

inline uint32_t word3(const uint8_t* p) { return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16; }

// the half block (24 bytes at p): dot with xh (64 permuted activations), or dequantized into out
inline float half3_dot(const uint8_t* p, const float* lut, const float* xh) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 8; ++k) s += lut[(word3(p + 3 * i) >> (3 * k)) & 7] * xh[8 * k + i];
    return s;
}
inline void half3_dequant(const uint8_t* p, const float* lut, float* out) {
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 8; ++k) out[8 * k + i] = lut[(word3(p + 3 * i) >> (3 * k)) & 7];
}

template <int B>
void gemv_rows(const sq_weight& w, const float* xp, float* y, int64_t r0, int64_t r1) {
    const int64_t nb = n_blocks(w.n, w.bits), n = w.n;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.packed + r * w.row_bytes;
        float lut_buf[256];
        const float* lut = row_lut(w, r, lut_buf);
        float acc[B] = {0.f};
        for (int64_t k = 0; k < nb; ++k) {
            if (w.bits == 4) {
                const uint8_t* p = row + 16 * k;
                const float* xk = xp + 32 * k;
                for (int i = 0; i < 16; ++i) {
                    const float lo = lut[p[i] & 15], hi = lut[p[i] >> 4];
                    for (int b = 0; b < B; ++b) acc[b] += lo * xk[b * n + i] + hi * xk[b * n + 16 + i];
                }
            } else {  // 3 bits
                const uint8_t* p = row + 48 * k;
                const float* xk = xp + 128 * k;
                for (int i = 0; i < 16; ++i) {
                    const uint32_t word = word3(p + 3 * i);
                    for (int s = 0; s < 8; ++s) {
                        const float v = lut[(word >> (3 * s)) & 7];
                        for (int b = 0; b < B; ++b) acc[b] += v * xk[b * n + 16 * s + i];
                    }
                }
            }
        }
        const int64_t half = half_start(n, w.bits), tail = tail_start(n, w.bits);
        for (int b = 0; b < B; ++b) {
            if (tail != half) acc[b] += half3_dot(row + 48 * nb, lut, xp + b * n + half);
            y[b * w.rows + r] = acc[b] + tail_and_sparse(w, r, lut, xp + b * n, tail);
        }
    }
}

void dequant_row(const sq_weight& w, int64_t r, float* out) {
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
    tail_and_sparse_dequant(w, r, lut, out, tail_start(w.n, w.bits));
}

// dense rows: y[b][r] = w[r] . x[b], one sequential sum per output (the same for every batch size)
template <class W, int B>
void dense_rows(const void* wv, int64_t n, const float* x, float* y, int64_t rows, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const typename W::T* wr = (const typename W::T*)wv + r * n;
        for (int b = 0; b < B; ++b) {
            float s = 0.0f;
            for (int64_t k = 0; k < n; ++k) s += W::get(wr + k) * x[b * n + k];
            y[b * rows + r] = s;
        }
    }
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

// the 3-bit half block (24 bytes at p): dot with xh (64 permuted activations), or dequantized into out
inline float half3_dot(const uint8_t* p, const float* lut, const float* xh) {
    const __m256 l8 = _mm256_loadu_ps(lut);
    const __m256i m = _mm256_set1_epi32(7);
    __m256i words = words3(p);
    __m256 acc = _mm256_setzero_ps();
    for (int s = 0; s < 8; ++s, words = _mm256_srli_epi32(words, 3))
        acc = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(l8, _mm256_and_si256(words, m)), _mm256_loadu_ps(xh + 8 * s), acc);
    return hsum(acc);
}
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

template <int B>
void gemv_rows(const sq_weight& w, const float* xp, float* y, int64_t r0, int64_t r1) {
    const int64_t n = w.n, nb = n_blocks(n, w.bits), half = half_start(n, w.bits),
                  tail = tail_start(n, w.bits);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.packed + r * w.row_bytes;
        float lut_buf[256];
        const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
        __m256 a0[B], a1[B];
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) a0[b] = a1[b] = _mm256_setzero_ps();
        if (w.bits == 4) {
            const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
            const __m256i m = _mm256_set1_epi32(15);
            for (int64_t k = 0; k < nb; ++k)
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + 16 * k + 8 * h)));
                    const __m256 w0 = lookup16(lo, hi, _mm256_and_si256(v, m));
                    const __m256 w1 = lookup16(lo, hi, _mm256_srli_epi32(v, 4));
                    const float* xk = xp + 32 * k + 8 * h;
#pragma GCC unroll 8
                    for (int b = 0; b < B; ++b) {
                        a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk + b * n), a0[b]);
                        a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + b * n + 16), a1[b]);
                    }
                }
        } else if (w.bits == 3) {
            const __m256 l8 = _mm256_loadu_ps(lut);
            const __m256i m = _mm256_set1_epi32(7);
            for (int64_t k = 0; k < nb; ++k)
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    __m256i words = words3(row + 48 * k + 24 * h);
                    const float* xk = xp + 128 * k + 8 * h;
#pragma GCC unroll 4
                    for (int s = 0; s < 8; s += 2) {
                        const __m256 w0 = _mm256_permutevar8x32_ps(l8, _mm256_and_si256(words, m));
                        const __m256 w1 = _mm256_permutevar8x32_ps(l8, _mm256_and_si256(_mm256_srli_epi32(words, 3), m));
                        words = _mm256_srli_epi32(words, 6);
#pragma GCC unroll 8
                        for (int b = 0; b < B; ++b) {
                            a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk + b * n + 16 * s), a0[b]);
                            a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + b * n + 16 * s + 16), a1[b]);
                        }
                    }
                }
        }
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
            float sum = hsum(_mm256_add_ps(a0[b], a1[b])) + tail_and_sparse(w, r, lut, xp + b * n, tail);
            if (tail != half) sum += half3_dot(row + 48 * nb, lut, xp + b * n + half);
            y[b * w.rows + r] = sum;
        }
    }
}

inline void dequant_half_and_tail(const sq_weight& w, int64_t r, const float* lut, float* out) {
    const uint8_t* row = w.packed + r * w.row_bytes;
    if (has_half(w.n, w.bits)) half3_dequant(row + 48 * n_blocks(w.n, w.bits), lut, out + half_start(w.n, w.bits));
    tail_and_sparse_dequant(w, r, lut, out, tail_start(w.n, w.bits));
}

void dequant_row(const sq_weight& w, int64_t r, float* out) {
    float lut_buf[256];
    const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
    decode_blocks(w, r, lut, [&](int64_t pos, __m256 wv) { _mm256_storeu_ps(out + pos, wv); });
    dequant_half_and_tail(w, r, lut, out);
}

// dense float32 rows: 8 lanes along k, one accumulator per activation row, then hsum and the scalar tail; the
// same instruction sequence for every output whatever B is, so a row's result never depends on its batch
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

template <class W, int B>
void dense_rows(const void* wv, int64_t n, const float* x, float* y, int64_t rows, int64_t r0, int64_t r1) {
    const int64_t whole = n - n % 8;
    for (int64_t r = r0; r < r1; ++r) {
        const typename W::T* wr = (const typename W::T*)wv + r * n;
        __m256 acc[B];
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
        for (int64_t k = 0; k < whole; k += 8) {
            const __m256 wk = load8w<W>(wr + k);
#pragma GCC unroll 8
            for (int b = 0; b < B; ++b) acc[b] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + b * n + k), acc[b]);
        }
        for (int b = 0; b < B; ++b) {
            float s = hsum(acc[b]);
            for (int64_t k = whole; k < n; ++k) s += W::get(wr + k) * x[b * n + k];
            y[b * rows + r] = s;
        }
    }
}

}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VBMI): 16 lanes, one whole block at a time; the LUT lives in one register and one permute
// looks up 16 weights. Two accumulators per activation row hide the FMA latency.
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

// The accumulators are plain arrays indexed by compile-time constants only (no visitor here), so that
// GCC keeps all 2*B of them in registers.
template <int B>
void gemv_rows(const sq_weight& w, const float* xp, float* y, int64_t r0, int64_t r1) {
    const int64_t n = w.n, nb = n_blocks(n, w.bits), half = half_start(n, w.bits),
                  tail = tail_start(n, w.bits);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.packed + r * w.row_bytes;
        float lut_buf[256];
        const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
        __m512 a0[B], a1[B];
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) a0[b] = a1[b] = _mm512_setzero_ps();
        if (w.bits == 4) {
            const __m512 l16 = _mm512_loadu_ps(lut);
            const __m512i m = _mm512_set1_epi32(15);
            for (int64_t k = 0; k < nb; ++k) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * k)));
                const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(v, m), l16);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), l16);
                const float* xk = xp + 32 * k;
#pragma GCC unroll 8
                for (int b = 0; b < B; ++b) {
                    a0[b] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xk + b * n), a0[b]);
                    a1[b] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xk + b * n + 16), a1[b]);
                }
            }
        } else if (w.bits == 3) {
            const __m512 l8 = _mm512_maskz_loadu_ps(0xFF, lut);
            const __m512i m = _mm512_set1_epi32(7);
            for (int64_t k = 0; k < nb; ++k) {
                __m512i words = words3(row + 48 * k);
                const float* xk = xp + 128 * k;
#pragma GCC unroll 4
                for (int s = 0; s < 8; s += 2) {
                    const __m512 w0 = _mm512_permutexvar_ps(_mm512_and_si512(words, m), l8);
                    const __m512 w1 = _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(words, 3), m), l8);
                    words = _mm512_srli_epi32(words, 6);
#pragma GCC unroll 8
                    for (int b = 0; b < B; ++b) {
                        a0[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xk + b * n + 16 * s), a0[b]);
                        a1[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xk + b * n + 16 * s + 16), a1[b]);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b])) + tail_and_sparse(w, r, lut, xp + b * n, tail);
            if (tail != half) sum += avx2::half3_dot(row + 48 * nb, lut, xp + b * n + half);
            y[b * w.rows + r] = sum;
        }
    }
}

void dequant_row(const sq_weight& w, int64_t r, float* out) {
    float lut_buf[256];
    const float* lut = avx2::row_lut_f16c(w, r, lut_buf);
    decode_blocks(w, r, lut, [&](int64_t pos, __m512 wv) { _mm512_storeu_ps(out + pos, wv); });
    avx2::dequant_half_and_tail(w, r, lut, out);
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

// dense rows, as avx2::dense_rows with 16 lanes
template <class W, int B>
void dense_rows(const void* wv, int64_t n, const float* x, float* y, int64_t rows, int64_t r0, int64_t r1) {
    const int64_t whole = n - n % 16;
    for (int64_t r = r0; r < r1; ++r) {
        const typename W::T* wr = (const typename W::T*)wv + r * n;
        __m512 acc[B];
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
        for (int64_t k = 0; k < whole; k += 16) {
            const __m512 wk = load16w<W>(wr + k);
#pragma GCC unroll 8
            for (int b = 0; b < B; ++b) acc[b] = _mm512_fmadd_ps(wk, _mm512_loadu_ps(x + b * n + k), acc[b]);
        }
        for (int b = 0; b < B; ++b) {
            float s = _mm512_reduce_add_ps(acc[b]);
            for (int64_t k = whole; k < n; ++k) s += W::get(wr + k) * x[b * n + k];
            y[b * rows + r] = s;
        }
    }
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
typedef void (*gemv_fn)(const sq_weight&, const float*, float*, int64_t, int64_t);
typedef void (*dequant_fn)(const sq_weight&, int64_t, float*);

template <template <int> class Impl>
gemv_fn pick_batch(int64_t b) {
    switch (b) {
        case 1: return Impl<1>::run;
        case 2: return Impl<2>::run;
        case 3: return Impl<3>::run;
        case 4: return Impl<4>::run;
        case 5: return Impl<5>::run;
        case 6: return Impl<6>::run;
        case 7: return Impl<7>::run;
        default: return Impl<8>::run;
    }
}
template <int B> struct Scalar { static void run(const sq_weight& w, const float* x, float* y, int64_t a, int64_t b) { scalar::gemv_rows<B>(w, x, y, a, b); } };
template <int B> struct Avx2 { static void run(const sq_weight& w, const float* x, float* y, int64_t a, int64_t b) { avx2::gemv_rows<B>(w, x, y, a, b); } };
template <int B> struct Avx512 { static void run(const sq_weight& w, const float* x, float* y, int64_t a, int64_t b) { avx512::gemv_rows<B>(w, x, y, a, b); } };

gemv_fn gemv_for(int isa, int64_t b) {
    if (isa == SQ_AVX512) return pick_batch<Avx512>(b);
    if (isa == SQ_AVX2) return pick_batch<Avx2>(b);
    return pick_batch<Scalar>(b);
}

typedef void (*dense_fn)(const void*, int64_t, const float*, float*, int64_t, int64_t, int64_t);

template <class W> struct ScalarDense { template <int B> static void run(const void* w, int64_t n, const float* x, float* y, int64_t rows, int64_t a, int64_t b) { scalar::dense_rows<W, B>(w, n, x, y, rows, a, b); } };
template <class W> struct Avx2Dense { template <int B> static void run(const void* w, int64_t n, const float* x, float* y, int64_t rows, int64_t a, int64_t b) { avx2::dense_rows<W, B>(w, n, x, y, rows, a, b); } };
template <class W> struct Avx512Dense { template <int B> static void run(const void* w, int64_t n, const float* x, float* y, int64_t rows, int64_t a, int64_t b) { avx512::dense_rows<W, B>(w, n, x, y, rows, a, b); } };

template <class Impl>
dense_fn pick_dense(int64_t b) {
    switch (b) {
        case 1: return Impl::template run<1>;
        case 2: return Impl::template run<2>;
        case 3: return Impl::template run<3>;
        case 4: return Impl::template run<4>;
        case 5: return Impl::template run<5>;
        case 6: return Impl::template run<6>;
        case 7: return Impl::template run<7>;
        default: return Impl::template run<8>;
    }
}

template <class W>
dense_fn dense_for_type(int isa, int64_t b) {
    if (isa == SQ_AVX512) return pick_dense<Avx512Dense<W>>(b);
    if (isa == SQ_AVX2) return pick_dense<Avx2Dense<W>>(b);
    return pick_dense<ScalarDense<W>>(b);
}

dense_fn dense_for(int isa, int32_t dtype, int64_t b) {
    if (dtype == SQ_DENSE_F16) return dense_for_type<WF16>(isa, b);
    if (dtype == SQ_DENSE_BF16) return dense_for_type<WBF16>(isa, b);
    return dense_for_type<WF32>(isa, b);
}

inline int64_t dense_elem_bytes(int32_t dtype) { return dtype == SQ_DENSE_F32 ? 4 : 2; }

dequant_fn dequant_for(int isa) {
    if (isa == SQ_AVX512) return avx512::dequant_row;
    if (isa == SQ_AVX2) return avx2::dequant_row;
    return scalar::dequant_row;
}

// rows per task: enough that a task streams a few KiB of codes, few enough that threads stay balanced
int64_t grain(const sq_weight& w) {
    const int64_t g = 8192 / (w.row_bytes > 0 ? w.row_bytes : 1);
    return g < 1 ? 1 : (g > 64 ? 64 : g);
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

// y float32 (batch, rows) = xp (batch, n) @ W^T, xp from sq_permute_x; activations in chunks of 8 rows
void sq_gemv(const sq_weight* w, const float* xp, int64_t batch, float* y, int32_t isa, int32_t threads) {
    const sq_weight wt = *w;
    const int64_t g = grain(wt), tasks = (wt.rows + g - 1) / g;
    // waking the other threads costs microseconds: small weights run on the calling thread
    if (wt.rows * wt.row_bytes * (batch < 8 ? batch : 8) < (64 << 10)) threads = 1;
    for (int64_t b0 = 0; b0 < batch; b0 += 8) {
        const int64_t bn = batch - b0 < 8 ? batch - b0 : 8;
        const gemv_fn fn = gemv_for(isa, bn);
        const float* xb = xp + b0 * wt.n;
        float* yb = y + b0 * wt.rows;
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1 && threads > 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t r0 = t * g, r1 = r0 + g < wt.rows ? r0 + g : wt.rows;
            fn(wt, xb, yb, r0, r1);
        }
    }
}

// the decode path in one call (one ctypes crossing per linear): y (batch, rows) = x @ W^T + bias, with
// x float32 (batch, n) in natural order (permuted into a scratch buffer of the calling thread) and bias
// float32 (rows) or NULL
void sq_linear(const sq_weight* w, const float* x, int64_t batch, float* y, const float* bias, int32_t isa,
               int32_t threads) {
    static thread_local std::vector<float> scratch;
    if ((int64_t)scratch.size() < batch * w->n) scratch.resize((size_t)(batch * w->n));
    sq_permute_x(x, scratch.data(), batch, w->n, w->bits);
    sq_gemv(w, scratch.data(), batch, y, isa, threads);
    if (bias)
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t r = 0; r < w->rows; ++r) y[b * w->rows + r] += bias[r];
}

// rows [r0, r1) dequantized into out float32 (r1 - r0, n), in the kernel's column order, sparse values in place
void sq_dequant_rows(const sq_weight* w, int64_t r0, int64_t r1, float* out, int32_t isa, int32_t threads) {
    const sq_weight wt = *w;
    const dequant_fn fn = dequant_for(isa);
#pragma omp parallel for schedule(static) num_threads(threads) if (r1 - r0 > 4)
    for (int64_t r = r0; r < r1; ++r) fn(wt, r, out + (r - r0) * wt.n);
}

// y float32 (batch, rows) = x (batch, n) @ w^T + bias for a dense weight w (rows, n) of element type `dtype`
// (SQ_DENSE_F32, _F16 or _BF16, each element converted exactly to float32 as it is read: the same bits as the
// weight upcast to float32, kept in memory as the artifact stores it). Each output is one fixed-order dot product
// (dense_rows), so a row's result is the same at every batch size (the engine of squeeze serve batches what
// squeeze run computes one row at a time); activations in chunks of 8 rows
void sq_dense_linear_typed(const void* w, int32_t dtype, int64_t rows, int64_t n, const float* x, int64_t batch,
                           float* y, const float* bias, int32_t isa, int32_t threads) {
    const int64_t g = 64, tasks = (rows + g - 1) / g;
    if (rows * n * dense_elem_bytes(dtype) < (256 << 10)) threads = 1;
    for (int64_t b0 = 0; b0 < batch; b0 += 8) {
        const int64_t bn = batch - b0 < 8 ? batch - b0 : 8;
        const dense_fn fn = dense_for(isa, dtype, bn);
        const float* xb = x + b0 * n;
        float* yb = y + b0 * rows;
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1 && threads > 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t r0 = t * g, r1 = r0 + g < rows ? r0 + g : rows;
            fn(w, n, xb, yb, rows, r0, r1);
        }
    }
    if (bias)
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t r = 0; r < rows; ++r) y[b * rows + r] += bias[r];
}

// sq_dense_linear_typed for a float32 weight
void sq_dense_linear(const float* w, int64_t rows, int64_t n, const float* x, int64_t batch, float* y,
                     const float* bias, int32_t isa, int32_t threads) {
    sq_dense_linear_typed(w, SQ_DENSE_F32, rows, n, x, batch, y, bias, isa, threads);
}

}  // extern "C"
