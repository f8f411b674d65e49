// squeeze's W4A8 CPU kernel: y = x @ W^T for a 3- or 4-bit LUT weight, in int8 x int8 -> int32 arithmetic.
//
// Built together with cpu_lut.cpp (one library, same C ABI style, loaded by cpu_build.py).
//
// The math (squeeze/runtime/kernels/reference.py, w4a8_matmul_reference, is the same written in torch):
// - weight row r: its LUT as int8 levels L[r, 0..15] with one float32 scale sw[r] (made once at load time);
//   W[r, c] ~ L[r, code(r, c)] * sw[r];
// - activation row b: amax = max |x[b, :]|, inv = 127 / amax, sx = amax / 127 (float32; 0 and 0 when amax is
//   0), q[b, c] = nearbyint(x[b, c] * inv) clamped to [-127, 127] (round half to even, as torch.round);
// - acc[b, r] = sum_c q[b, c] * L[r, code(r, c)]: EXACT in int32 (|term| <= 127 * 127), so its value does not
//   depend on the order of the terms, the instruction set, the tiling, the thread count or the other rows of
//   the batch: every row gets the same bits at every batch size, on every path (batch invariance);
// - y[b, r] = (float)acc * (sx[b] * sw[r]) + s + bias[r], with s the float32 sum, in CSR order from 0, of
//   resid[j] * x[b, col[j]] over the row's sparse entries (resid = exact value - L * sw, so the outliers keep
//   their exact weights and meet the unquantized activations).
//
// Layout: a row's codes are cut into chunks of 128 columns (64 bytes at 4 bits, 48 at 3 bits; the last chunk
// zero-padded, or a half chunk of 64 columns with planes of 32 when at most 64 columns are left). A chunk decodes to 128 int8 weights in two planes of 64: at 4 bits plane 0 holds the even
// columns (the low nibbles, byte j -> column 2j) and plane 1 the odd ones; at 3 bits (16 groups of 8 codes
// in 3 bytes) plane 0 holds codes 0-3 of each group (byte 4g + t -> column 8g + t), plane 1 codes 4-7. The
// quantized activations are laid out the same way (padding columns get 0), so every load is contiguous.
// A weight panel (a few rows) is decoded ONCE per call into that layout and multiplied by every activation
// row, so the decode cost does not grow with the batch.
// - AVX-512 VNNI: the panel holds L + 128 as uint8 and vpdpbusd multiplies it by the int8 activations;
//   the 128 * sum_c q[b, c] it adds is subtracted per activation row.
// - AVX2: the panel holds L (int8) and |L| (uint8); vpmaddubsw(|L|, sign(L) * q) cannot saturate (a pair sums
//   to at most 2 * 127 * 127 < 32767), vpmaddwd by ones widens it to int32.
// - scalar: the same integers, one code at a time, in natural column order.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_codes.h"

extern "C" {

typedef struct {
    const uint8_t* packed;  // (rows, row_bytes): the artifact's LSB-first code rows
    const int8_t* levels;   // (rows, 16): the LUT as int8 levels (3 bits: 8 used, the rest 0)
    const float* scale;     // (rows): sw
    const int32_t* rowptr;  // (rows + 1) or NULL: the sparse part, CSR
    const int32_t* cols;    // (nnz) natural columns
    const float* resid;     // (nnz) exact value - level * scale
    int64_t rows;
    int64_t n;
    int64_t row_bytes;
    int32_t bits;  // 3 or 4
} sq_w8;

}  // extern "C"

namespace {

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };  // cpu_lut.cpp's SQ_* numbering

constexpr int64_t CHUNK = 128;  // columns per chunk
constexpr int64_t OUTER_MIN_ROWS = 8;  // activation rows from which AVX-512 takes the outer-product form
inline int64_t chunk_bytes(int bits) { return bits == 4 ? 64 : 48; }
// chunks of 128 columns, and a HALF chunk of 64 when at most 64 columns follow the last whole one (576 = 4.5
// chunks: padding it to 640 would cost 11% more products)
inline bool has_half(int64_t n) { return n % CHUNK != 0 && n % CHUNK <= 64; }
inline int64_t full_chunks(int64_t n) { return n / CHUNK + (n % CHUNK > 64 ? 1 : 0); }
inline int64_t padded(int64_t n) { return full_chunks(n) * CHUNK + (has_half(n) ? 64 : 0); }

// position of column c of an n-column row in the chunk layout (header comment); the half chunk has planes
// of 32 (the same order within them)
inline int64_t position(int64_t c, int bits, int64_t n) {
    const int64_t base = c / CHUNK * CHUNK, t = c % CHUNK, plane = base < full_chunks(n) * CHUNK ? 64 : 32;
    if (bits == 4) return base + (t & 1) * plane + t / 2;
    const int64_t g = t / 8, s = t % 8;
    return base + (s / 4) * plane + 4 * g + s % 4;
}

inline int code_at(const uint8_t* row, int64_t c, int bits) {
    const int64_t bit = c * bits;
    uint32_t v = row[bit >> 3];
    if ((bit & 7) + bits > 8) v |= (uint32_t)row[(bit >> 3) + 1] << 8;
    return (int)((v >> (bit & 7)) & ((1u << bits) - 1));
}

// chunk k of a row: a pointer to its bytes, or to `buf` holding the last, partial chunk zero-padded
inline const uint8_t* chunk_ptr(const uint8_t* row, int64_t row_bytes, int64_t k, int bits, uint8_t* buf) {
    const int64_t cb = chunk_bytes(bits), at = k * cb;
    if (at + cb <= row_bytes) return row + at;
    memset(buf, 0, 64);
    memcpy(buf, row + at, (size_t)(row_bytes - at));
    return buf;
}

// ---------------------------------------------------------------------------------------------------------
// Activations: row b quantized (sx, q in natural order into `nat`), then laid out into `out` (np bytes, zero
// padding) for the SIMD paths. Inlined into each ISA's caller so that the loops vectorise for it.
__attribute__((always_inline)) inline void quantize_row(const float* xr, int64_t n, int bits, int8_t* nat,
                                                        int8_t* out, float* sx, int32_t* sumq) {
    float amax = 0.f;
    for (int64_t c = 0; c < n; ++c) amax = fmaxf(amax, fabsf(xr[c]));
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    *sx = amax > 0.f ? amax / 127.0f : 0.f;
    int32_t sum = 0;
    for (int64_t c = 0; c < n; ++c) {
        // round half to even by the 1.5 * 2^23 trick (exact for |v| < 2^22; |v| <= 127 here): nearbyintf
        // without SSE4.1 is a library call per element
        float v = xr[c] * inv;
        v = (v + 12582912.0f) - 12582912.0f;
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        nat[c] = (int8_t)(int32_t)v;
        sum += (int32_t)v;
    }
    *sumq = sum;
    if (!out) return;
    const int64_t np = padded(n), whole = n / CHUNK;
    memset(out + whole * CHUNK, 0, (size_t)(np - whole * CHUNK));
    for (int64_t k = 0; k < whole; ++k) {  // whole chunks: a deinterleave of bytes (4 bits) or dwords (3 bits)
        const int8_t* src = nat + k * CHUNK;
        int8_t* dst = out + k * CHUNK;
        if (bits == 4) {
            for (int j = 0; j < 64; ++j) {
                dst[j] = src[2 * j];
                dst[64 + j] = src[2 * j + 1];
            }
        } else {
            for (int g = 0; g < 16; ++g) {
                memcpy(dst + 4 * g, src + 8 * g, 4);
                memcpy(dst + 64 + 4 * g, src + 8 * g + 4, 4);
            }
        }
    }
    for (int64_t c = whole * CHUNK; c < n; ++c) out[position(c, bits, n)] = nat[c];
}

// the float32 result of one output from its exact integer sum (fixed formula; header comment)
// the sparse sum of row r for activation row xr (0 without sparse entries), in CSR order from 0
inline float sparse_sum(const sq_w8& w, int64_t r, const float* xr) {
    float s = 0.f;
    if (w.rowptr)
        for (int32_t j = w.rowptr[r]; j < w.rowptr[r + 1]; ++j) s += w.resid[j] * xr[w.cols[j]];
    return s;
}

inline float finish(const sq_w8& w, int64_t r, int32_t acc, float sx, const float* xr, const float* bias) {
    float y = (float)acc * (sx * w.scale[r]);
    y = y + sparse_sum(w, r, xr);
    if (bias) y = y + bias[r];
    return y;
}

// y[r .. r+3] of one activation row from 4 exact sums: finish() four times, in SSE (the same IEEE operations)
inline void finish4(const sq_w8& w, int64_t r, __m128i acc, float sx, const float* xr, const float* bias, float* y) {
    __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(acc), _mm_mul_ps(_mm_set1_ps(sx), _mm_loadu_ps(w.scale + r)));
    if (w.rowptr && w.rowptr[r + 4] > w.rowptr[r])
        v = _mm_add_ps(v, _mm_setr_ps(sparse_sum(w, r, xr), sparse_sum(w, r + 1, xr), sparse_sum(w, r + 2, xr),
                                      sparse_sum(w, r + 3, xr)));
    else
        v = _mm_add_ps(v, _mm_setzero_ps());  // + 0.0f as finish() adds it (-0 becomes +0 there too)
    if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + r));
    _mm_storeu_ps(y, v);
}

// ---------------------------------------------------------------------------------------------------------
namespace scalar {

void quantize_one(const float* xr, int64_t n, int bits, int8_t* nat, int8_t* out, float* sx, int32_t* sumq) {
    quantize_row(xr, n, bits, nat, out, sx, sumq);
}

void rows(const sq_w8& w, const int8_t* q, const float* sx, const float* x, float* y, const float* bias, int64_t m,
          int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.packed + r * w.row_bytes;
        const int8_t* lv = w.levels + 16 * r;
        for (int64_t b = 0; b < m; ++b) {
            const int8_t* qb = q + b * w.n;
            int32_t acc = 0;
            for (int64_t c = 0; c < w.n; ++c) acc += (int32_t)lv[code_at(row, c, w.bits)] * qb[c];
            y[b * w.rows + r] = finish(w, r, acc, sx[b], x + b * w.n, bias);
        }
    }
}

}  // namespace scalar

// ---------------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

void quantize_one(const float* xr, int64_t n, int bits, int8_t* nat, int8_t* out, float* sx, int32_t* sumq) {
    quantize_row(xr, n, bits, nat, out, sx, sumq);
}

using sq_codes::avx2::words3;  // 8 groups of three bytes -> 8 dwords (cpu_codes.h)

// the four 3-bit codes at bits 0, 3, 6, 9 of each dword moved to its bytes 0..3
inline __m256i spread4(__m256i w) {
    const __m256i a = _mm256_and_si256(w, _mm256_set1_epi32(7));
    const __m256i b = _mm256_and_si256(_mm256_slli_epi32(w, 5), _mm256_set1_epi32(0x700));
    const __m256i c = _mm256_and_si256(_mm256_slli_epi32(w, 10), _mm256_set1_epi32(0x70000));
    const __m256i d = _mm256_and_si256(_mm256_slli_epi32(w, 15), _mm256_set1_epi32(0x7000000));
    return _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
}

// the half chunk at p (32 bytes at 4 bits, 24 at 3) looked up in tbl: v[0] plane 0, v[1] plane 1
inline void half_chunk(const uint8_t* p, int bits, __m256i tbl, __m256i* v) {
    if (bits == 4) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)p), lo4 = _mm256_set1_epi8(15);
        v[0] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(b, lo4));
        v[1] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4));
    } else {
        const __m256i words = words3(p);
        v[0] = _mm256_shuffle_epi8(tbl, spread4(words));
        v[1] = _mm256_shuffle_epi8(tbl, spread4(_mm256_srli_epi32(words, 12)));
    }
}

// row r decoded into `out` (int8 levels, np bytes) and `mag` (their absolute values)
void decode_row(const sq_w8& w, int64_t r, int8_t* out, uint8_t* mag) {
    const int64_t nch = full_chunks(w.n);
    const uint8_t* row = w.packed + r * w.row_bytes;
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(w.levels + 16 * r)));
    const __m256i lo4 = _mm256_set1_epi8(15);
    alignas(64) uint8_t buf[64];
    for (int64_t k = 0; k < nch; ++k) {
        const uint8_t* p = chunk_ptr(row, w.row_bytes, k, w.bits, buf);
        __m256i v[4];
        if (w.bits == 4) {
            for (int h = 0; h < 2; ++h) {
                const __m256i b = _mm256_loadu_si256((const __m256i*)(p + 32 * h));
                v[h] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(b, lo4));
                v[2 + h] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4));
            }
        } else {
            for (int h = 0; h < 2; ++h) {
                const __m256i words = words3(p + 24 * h);
                v[h] = _mm256_shuffle_epi8(tbl, spread4(words));
                v[2 + h] = _mm256_shuffle_epi8(tbl, spread4(_mm256_srli_epi32(words, 12)));
            }
        }
        for (int i = 0; i < 4; ++i) {
            _mm256_storeu_si256((__m256i*)(out + CHUNK * k + 32 * i), v[i]);
            _mm256_storeu_si256((__m256i*)(mag + CHUNK * k + 32 * i), _mm256_abs_epi8(v[i]));
        }
    }
    if (has_half(w.n)) {  // 64 columns: planes of 32, each one register
        __m256i v[2];
        half_chunk(chunk_ptr(row, w.row_bytes, nch, w.bits, buf), w.bits, tbl, v);
        for (int i = 0; i < 2; ++i) {
            _mm256_storeu_si256((__m256i*)(out + CHUNK * nch + 32 * i), v[i]);
            _mm256_storeu_si256((__m256i*)(mag + CHUNK * nch + 32 * i), _mm256_abs_epi8(v[i]));
        }
    }
}

inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// acc[4 * b + i] = sum over the row of w_i . q_b for 4 panel rows and MB activation rows
template <int MB>
void tile(const int8_t* w, const uint8_t* mag, int64_t np, const int8_t* q, int32_t* acc) {
    __m256i a[4][MB];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) a[i][b] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < np; k += 32) {
        __m256i xv[MB];
        for (int b = 0; b < MB; ++b) xv[b] = _mm256_loadu_si256((const __m256i*)(q + b * np + k));
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + i * np + k));
            const __m256i mv = _mm256_loadu_si256((const __m256i*)(mag + i * np + k));
            for (int b = 0; b < MB; ++b) {
                const __m256i p = _mm256_maddubs_epi16(mv, _mm256_sign_epi8(xv[b], wv));
                a[i][b] = _mm256_add_epi32(a[i][b], _mm256_madd_epi16(p, ones));
            }
        }
    }
    for (int b = 0; b < MB; ++b)
        for (int i = 0; i < 4; ++i) acc[4 * b + i] = hsum(a[i][b]);
}

}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")
namespace avx512 {

void quantize_one(const float* xr, int64_t n, int bits, int8_t* nat, int8_t* out, float* sx, int32_t* sumq) {
    quantize_row(xr, n, bits, nat, out, sx, sumq);
}

using sq_codes::avx512::words3;  // 16 groups of three bytes -> 16 dwords (cpu_codes.h)

inline __m512i spread4(__m512i w) {
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi32(7));
    const __m512i b = _mm512_and_si512(_mm512_slli_epi32(w, 5), _mm512_set1_epi32(0x700));
    const __m512i c = _mm512_and_si512(_mm512_slli_epi32(w, 10), _mm512_set1_epi32(0x70000));
    const __m512i d = _mm512_and_si512(_mm512_slli_epi32(w, 15), _mm512_set1_epi32(0x7000000));
    return _mm512_or_si512(_mm512_or_si512(a, b), _mm512_or_si512(c, d));
}

// row r decoded into `out` as uint8 levels + 128 (np bytes)
void decode_row(const sq_w8& w, int64_t r, uint8_t* out) {
    const int64_t nch = full_chunks(w.n);
    const uint8_t* row = w.packed + r * w.row_bytes;
    const __m512i tbl = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(w.levels + 16 * r))), _mm512_set1_epi8((char)0x80));
    const __m512i lo4 = _mm512_set1_epi8(15);
    alignas(64) uint8_t buf[64];
    for (int64_t k = 0; k < nch; ++k) {
        const uint8_t* p = chunk_ptr(row, w.row_bytes, k, w.bits, buf);
        __m512i v0, v1;
        if (w.bits == 4) {
            const __m512i b = _mm512_loadu_si512(p);
            v0 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(b, lo4));
            v1 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4));
        } else {
            const __m512i words = words3(p);
            v0 = _mm512_shuffle_epi8(tbl, spread4(words));
            v1 = _mm512_shuffle_epi8(tbl, spread4(_mm512_srli_epi32(words, 12)));
        }
        _mm512_storeu_si512(out + CHUNK * k, v0);
        _mm512_storeu_si512(out + CHUNK * k + 64, v1);
    }
    if (has_half(w.n)) {  // 64 columns in one register: the AVX2 form with the same table
        __m256i v[2];
        avx2::half_chunk(chunk_ptr(row, w.row_bytes, nch, w.bits, buf), w.bits, _mm512_castsi512_si256(tbl), v);
        _mm256_storeu_si256((__m256i*)(out + CHUNK * nch), v[0]);
        _mm256_storeu_si256((__m256i*)(out + CHUNK * nch + 32), v[1]);
    }
}

// the sums of the 16 lanes of a0..a3, as 4 dwords
inline __m128i reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// acc += u8 a . s8 b (per dword: 4 products), in place: with the intrinsic GCC 12 copies every accumulator
// around each vpdpbusd in the tile loop (two extra moves per product), which the asm form avoids
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

// acc[4 * b + i] = sum over the row of (w_i + 128) . q_b for 4 panel rows and MB activation rows
template <int MB>
void tile(const uint8_t* w, int64_t np, const int8_t* q, int32_t* acc) {
    __m512i a[4][MB];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) a[i][b] = _mm512_setzero_si512();
    for (int64_t k = 0; k < np; k += 64) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) wv[i] = _mm512_loadu_si512(w + i * np + k);
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) {
            const __m512i xv = _mm512_loadu_si512(q + b * np + k);
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) a[i][b] = dpbusd(a[i][b], wv[i], xv);
        }
    }
    for (int b = 0; b < MB; ++b) _mm_storeu_si128((__m128i*)(acc + 4 * b), reduce4(a[0][b], a[1][b], a[2][b], a[3][b]));
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// Weight rows [r0, r1) of one task: decoded 4 at a time (rows past r1 repeat the last one and are dropped),
// each group multiplied by every activation row, 4 (AVX-512) or 2 (AVX2: 16 registers) at a time.
struct Call {
    const sq_w8* w;
    const int8_t* q;  // (m, np) laid out
    const float* sx;
    const int32_t* sumq;
    const float* x;
    const float* bias;
    float* y;
    int64_t m;
    int isa;
};

// ---------------------------------------------------------------------------------------------------------
// AVX-512 for 4 or more activation rows: the OUTER-product form. 16 weight rows are decoded, then transposed so
// that each 64-byte vector holds the same 4 columns of all 16 rows; one vpdpbusd with the activation row's 4
// bytes broadcast then adds 4 products to each of the 16 rows' sums. No horizontal sums, and the float32
// epilogue runs 16 rows at a time: at 576 columns the dot-product tiles above spend about as long reducing
// and finishing as multiplying. The sums are the same integers, so the result is bit for bit the same.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")
namespace outer {

// r[0..15]: 16 rows of 16 dwords -> out[k] = dword k of rows 0..15
inline void transpose16(const __m512i* r, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // u[4i + e], lane L: dword 4L + e of rows 4i .. 4i+3
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
        out[e] = _mm512_shuffle_i32x4(a, c, 0x88);
        out[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
        out[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
        out[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

// acc += u8 w . s8 (4 bytes at x, broadcast to every dword)
inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
    return acc;
}

// sums[b] (16 rows) for MB activation rows from the transposed panel tp (np / 4 vectors)
template <int MB>
inline void block(const uint8_t* tp, int64_t np, const int8_t* q, __m512i* sums) {
    __m512i a[MB];
#pragma GCC unroll 8
    for (int b = 0; b < MB; ++b) a[b] = _mm512_setzero_si512();
    for (int64_t k = 0; k < np; k += 4) {
        const __m512i wv = _mm512_load_si512(tp + 16 * k);
#pragma GCC unroll 8
        for (int b = 0; b < MB; ++b) a[b] = dpbusd_bcst(a[b], wv, q + b * np + k);
    }
#pragma GCC unroll 8
    for (int b = 0; b < MB; ++b) sums[b] = a[b];
}

void rows(const Call& c, int64_t r0, int64_t r1) {
    const sq_w8& w = *c.w;
    const int64_t np = padded(w.n);
    static thread_local std::vector<uint8_t> buf;
    if ((int64_t)buf.size() < 32 * np + 64) buf.resize((size_t)(32 * np + 64));
    uint8_t* dec = buf.data();  // (16, np): the rows as decoded
    uint8_t* tp = (uint8_t*)(((uintptr_t)(dec + 16 * np) + 63) & ~(uintptr_t)63);  // (np / 4, 16) dwords
    for (int64_t g = r0; g < r1; g += 16) {
        const int live = r1 - g < 16 ? (int)(r1 - g) : 16;
        for (int i = 0; i < 16; ++i) avx512::decode_row(w, g + (i < live ? i : live - 1), dec + i * np);
        for (int64_t k = 0; k < np; k += 64) {
            __m512i r[16], t[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(dec + i * np + k);
            transpose16(r, t);
            for (int j = 0; j < 16; ++j) _mm512_store_si512(tp + 16 * (k + 4 * j), t[j]);
        }
        const __mmask16 mask = (__mmask16)((1u << live) - 1);
        const __m512 sw = _mm512_maskz_loadu_ps(mask, w.scale + g);
        const __m512 bias = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + g) : _mm512_setzero_ps();
        const bool sparse = w.rowptr && w.rowptr[g + live] > w.rowptr[g];
        for (int64_t b0 = 0; b0 < c.m; b0 += 8) {
            const int mb = c.m - b0 < 8 ? (int)(c.m - b0) : 8;
            const int8_t* qb = c.q + b0 * np;
            __m512i sums[8];
            switch (mb) {
                case 1: block<1>(tp, np, qb, sums); break;
                case 2: block<2>(tp, np, qb, sums); break;
                case 3: block<3>(tp, np, qb, sums); break;
                case 4: block<4>(tp, np, qb, sums); break;
                case 5: block<5>(tp, np, qb, sums); break;
                case 6: block<6>(tp, np, qb, sums); break;
                case 7: block<7>(tp, np, qb, sums); break;
                default: block<8>(tp, np, qb, sums); break;
            }
            for (int b = 0; b < mb; ++b) {  // finish() for 16 rows: the same IEEE operations in the same order
                const int64_t row = b0 + b;
                const __m512i acc = _mm512_sub_epi32(sums[b], _mm512_set1_epi32(128 * c.sumq[row]));
                __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(_mm512_set1_ps(c.sx[row]), sw));
                alignas(64) float s[16] = {0.f};
                if (sparse)
                    for (int i = 0; i < live; ++i) s[i] = sparse_sum(w, g + i, c.x + row * w.n);
                y = _mm512_add_ps(y, _mm512_load_ps(s));
                if (c.bias) y = _mm512_add_ps(y, bias);
                _mm512_mask_storeu_ps(c.y + row * w.rows + g, mask, y);
            }
        }
    }
}

}  // namespace outer
#pragma GCC pop_options

void simd_rows(const Call& c, int64_t r0, int64_t r1) {
    const sq_w8& w = *c.w;
    const int64_t np = padded(w.n);
    static thread_local std::vector<uint8_t> panel;
    if ((int64_t)panel.size() < 8 * np) panel.resize((size_t)(8 * np));
    uint8_t* pw = panel.data();
    uint8_t* pm = pw + 4 * np;
    int32_t acc[16];
    for (int64_t g = r0; g < r1; g += 4) {
        const int64_t live = r1 - g < 4 ? r1 - g : 4;
        for (int i = 0; i < 4; ++i) {
            const int64_t r = g + (i < live ? i : live - 1);
            if (c.isa == ISA_AVX512)
                avx512::decode_row(w, r, pw + i * np);
            else
                avx2::decode_row(w, r, (int8_t*)pw + i * np, pm + i * np);
        }
        const int step = c.isa == ISA_AVX512 ? 4 : 2;
        for (int64_t b0 = 0; b0 < c.m; b0 += step) {
            const int mb = c.m - b0 < step ? (int)(c.m - b0) : step;
            const int8_t* qb = c.q + b0 * np;
            if (c.isa == ISA_AVX512) {
                switch (mb) {
                    case 1: avx512::tile<1>(pw, np, qb, acc); break;
                    case 2: avx512::tile<2>(pw, np, qb, acc); break;
                    case 3: avx512::tile<3>(pw, np, qb, acc); break;
                    default: avx512::tile<4>(pw, np, qb, acc); break;
                }
            } else if (mb == 1) {
                avx2::tile<1>((const int8_t*)pw, pm, np, qb, acc);
            } else {
                avx2::tile<2>((const int8_t*)pw, pm, np, qb, acc);
            }
            for (int b = 0; b < mb; ++b) {
                __m128i a4 = _mm_loadu_si128((const __m128i*)(acc + 4 * b));
                if (c.isa == ISA_AVX512) a4 = _mm_sub_epi32(a4, _mm_set1_epi32(128 * c.sumq[b0 + b]));
                const float* xr = c.x + (b0 + b) * w.n;
                float* yr = c.y + (b0 + b) * w.rows;
                if (live == 4) {
                    finish4(w, g, a4, c.sx[b0 + b], xr, c.bias, yr + g);
                } else {
                    alignas(16) int32_t t[4];
                    _mm_store_si128((__m128i*)t, a4);
                    for (int i = 0; i < live; ++i) yr[g + i] = finish(w, g + i, t[i], c.sx[b0 + b], xr, c.bias);
                }
            }
        }
    }
}

}  // namespace

extern "C" {


// y float32 (m, rows) = x (m, n) float32 @ W^T + bias (float32 (rows) or NULL) in the W4A8 form (header comment);
// isa: 2 (AVX-512 with VNNI), 1 (AVX2) or 0 (scalar): the same bits on each
void sq_w8_linear(const sq_w8* wp, const float* x, int64_t m, float* y, const float* bias, int32_t isa,
                  int32_t threads) {
    const sq_w8 w = *wp;
    if (m <= 0 || w.rows <= 0) return;
    const bool simd = (isa == ISA_AVX512 || isa == ISA_AVX2) && (w.bits == 3 || w.bits == 4);
    const int64_t np = padded(w.n), width = simd ? np : w.n;
    static thread_local std::vector<int8_t> q;
    static thread_local std::vector<float> sx;
    static thread_local std::vector<int32_t> sumq;
    if ((int64_t)q.size() < m * width) q.resize((size_t)(m * width));
    if ((int64_t)sx.size() < m) {
        sx.resize((size_t)m);
        sumq.resize((size_t)m);
    }
    {
        int8_t* qd = q.data();
        float* sxd = sx.data();
        int32_t* sd = sumq.data();
        const int64_t n = w.n;
        const int bits = w.bits;
#pragma omp parallel num_threads(threads) if (m >= 16 && threads > 1)
        {
            std::vector<int8_t> nat(simd ? (size_t)n : 0);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < m; ++b) {
                const float* xr = x + b * n;
                if (!simd)
                    scalar::quantize_one(xr, n, bits, qd + b * n, nullptr, sxd + b, sd + b);
                else if (isa == ISA_AVX512)
                    avx512::quantize_one(xr, n, bits, nat.data(), qd + b * np, sxd + b, sd + b);
                else
                    avx2::quantize_one(xr, n, bits, nat.data(), qd + b * np, sxd + b, sd + b);
            }
        }
    }
    // small products run on the calling thread: waking the others costs microseconds (the GEMV's rule)
    if (w.rows * w.row_bytes * (m < 8 ? m : 8) < (64 << 10)) threads = 1;
    const int64_t g = 16, tasks = (w.rows + g - 1) / g;
    // the calling thread's buffers, by pointer (inside the parallel loop `q` would name each thread's own)
    const Call c{&w, q.data(), sx.data(), sumq.data(), x, bias, y, m, isa};
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1 && threads > 1)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t r0 = t * g, r1 = r0 + g < w.rows ? r0 + g : w.rows;
        if (simd && isa == ISA_AVX512 && m >= OUTER_MIN_ROWS)
            outer::rows(c, r0, r1);
        else if (simd)
            simd_rows(c, r0, r1);
        else
            scalar::rows(w, c.q, c.sx, x, y, bias, m, r0, r1);
    }
}

}  // extern "C"
