// squeeze's W4A8 CPU kernel: y = x @ W^T for a 3- or 4-bit LUT weight, in int8 x int8 -> int32 arithmetic.
//
// Built together with cpu_lut.cpp (one library, same C ABI style, loaded by cpu_build.py).
//
// The math (squeeze/runtime/kernels/reference.py, w4a8_matmul_reference, is the same written in torch):
// - weight row r: its LUT as int8 levels L[r, 0..15] with one float32 scale sw[r] (made once at load time);
//   W[r, c] ~ L[r, code(r, c)] * sw[r];
// - activations in GROUPS of 64 columns (group g: columns 64g .. 64g+63 of the call's x; the last one may be
//   shorter): for row b and group g, amax = max |x[b, c]| over the group, inv = 127 / amax,
//   sx[b, g] = amax / 127 (float32; 0 and 0 when amax is 0), q[b, c] = nearbyint(x[b, c] * inv) clamped to
//   [-127, 127] (round half to even, as torch.round). A group never spans two calls, so a tensor-parallel
//   shard's groups stay inside the shard;
// - acc[b, r, g] = sum over the group's columns of q[b, c] * L[r, code(r, c)]: EXACT in int32, so its value
//   does not depend on the order of the terms, the instruction set, the tiling or the other rows of the batch;
// - t = 0; for g = 0, 1, ..: t = t + (float)acc[b, r, g] * sx[b, g] (float32, each operation rounded);
//   y[b, r] = t * sw[r] + s + bias[r], with s the float32 sum, in CSR order from 0, of resid[j] * x[b, col[j]]
//   over the row's sparse entries (resid = exact value - L * sw: the outliers keep their exact weights and
//   meet the unquantized activations). One fixed sequence of float32 operations per output: every row gets
//   the same bits at every batch size, on every path (batch invariance).
//
// Layout: a row's codes are cut into chunks of 64 columns (32 bytes at 4 bits, 24 at 3 bits; the last chunk
// zero-padded), one chunk per activation group. A chunk decodes to 64 int8 weights in two planes of 32: at 4
// bits plane 0 holds the even columns (the low nibbles, byte j -> column 2j) and plane 1 the odd ones; at 3 bits
// (8 groups of 8 codes in 3 bytes) plane 0 holds codes 0-3 of each group (byte 4g + t -> column 8g + t), plane 1
// codes 4-7. The quantized activations are laid out the same way (padding columns get 0).
// - AVX-512 VNNI (every row count): 16 weight rows are decoded (L + 128 as uint8), then transposed so that each
//   64-byte vector holds the same 4 columns of the 16 rows; one vpdpbusd with 4 activation bytes broadcast adds
//   4 products to each of the 16 rows' sums; the 128 * sum_c q[b, c] that adds is subtracted per group.
// - AVX2: the panel holds L (int8) and |L| (uint8); vpmaddubsw(|L|, sign(L) * q) cannot saturate (a pair sums
//   to at most 2 * 127 * 127 < 32767), vpmaddwd by ones widens it to int32; one horizontal sum per group.
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

constexpr int64_t GROUP = 64;  // columns per activation group = per chunk of codes
inline int64_t chunk_bytes(int bits) { return bits == 4 ? 32 : 24; }
inline int64_t groups(int64_t n) { return (n + GROUP - 1) / GROUP; }
inline int64_t padded(int64_t n) { return groups(n) * GROUP; }

// position of column c in the chunk layout (header comment)
inline int64_t position(int64_t c, int bits) {
    const int64_t base = c / GROUP * GROUP, t = c % GROUP;
    if (bits == 4) return base + (t & 1) * 32 + t / 2;
    const int64_t g = t / 8, s = t % 8;
    return base + (s / 4) * 32 + 4 * g + s % 4;
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
    memset(buf, 0, 32);
    memcpy(buf, row + at, (size_t)(row_bytes - at));
    return buf;
}

// ---------------------------------------------------------------------------------------------------------
// Activations: row b quantized group by group (sx, sumq per group; q in natural order into `nat`), then laid
// out into `out` (np bytes, zero padding) for the SIMD paths. Inlined into each ISA's caller so that the loops
// vectorise for it.
__attribute__((always_inline)) inline void quantize_row(const float* xr, int64_t n, int bits, int8_t* nat,
                                                        int8_t* out, float* sx, int32_t* sumq) {
    for (int64_t g = 0; g * GROUP < n; ++g) {
        const int64_t c0 = g * GROUP, c1 = c0 + GROUP < n ? c0 + GROUP : n;
        float amax = 0.f;
        for (int64_t c = c0; c < c1; ++c) amax = fmaxf(amax, fabsf(xr[c]));
        const float inv = amax > 0.f ? 127.0f / amax : 0.f;
        sx[g] = amax > 0.f ? amax / 127.0f : 0.f;
        int32_t sum = 0;
        for (int64_t c = c0; c < c1; ++c) {
            // round half to even by the 1.5 * 2^23 trick (exact for |v| < 2^22; |v| <= 127 here): nearbyintf
            // without SSE4.1 is a library call per element
            float v = xr[c] * inv;
            v = (v + 12582912.0f) - 12582912.0f;
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            nat[c] = (int8_t)(int32_t)v;
            sum += (int32_t)v;
        }
        sumq[g] = sum;
    }
    if (!out) return;
    const int64_t np = padded(n), whole = n / GROUP;
    memset(out + whole * GROUP, 0, (size_t)(np - whole * GROUP));
    for (int64_t k = 0; k < whole; ++k) {  // whole chunks: a deinterleave of bytes (4 bits) or dwords (3 bits)
        const int8_t* src = nat + k * GROUP;
        int8_t* dst = out + k * GROUP;
        if (bits == 4) {
            for (int j = 0; j < 32; ++j) {
                dst[j] = src[2 * j];
                dst[32 + j] = src[2 * j + 1];
            }
        } else {
            for (int g = 0; g < 8; ++g) {
                memcpy(dst + 4 * g, src + 8 * g, 4);
                memcpy(dst + 32 + 4 * g, src + 8 * g + 4, 4);
            }
        }
    }
    for (int64_t c = whole * GROUP; c < n; ++c) out[position(c, bits)] = nat[c];
}

// the sparse sum of row r for activation row xr (0 without sparse entries), in CSR order from 0
inline float sparse_sum(const sq_w8& w, int64_t r, const float* xr) {
    float s = 0.f;
    if (w.rowptr)
        for (int32_t j = w.rowptr[r]; j < w.rowptr[r + 1]; ++j) s += w.resid[j] * xr[w.cols[j]];
    return s;
}

// y[b, r] from t (the groups' float32 sum): the fixed formula of the header comment
inline float finish(const sq_w8& w, int64_t r, float t, const float* xr, const float* bias) {
    float y = t * w.scale[r];
    y = y + sparse_sum(w, r, xr);
    if (bias) y = y + bias[r];
    return y;
}

// ---------------------------------------------------------------------------------------------------------
namespace scalar {

void quantize_one(const float* xr, int64_t n, int bits, int8_t* nat, int8_t* out, float* sx, int32_t* sumq) {
    quantize_row(xr, n, bits, nat, out, sx, sumq);
}

void rows(const sq_w8& w, const int8_t* q, const float* sx, const float* x, float* y, const float* bias, int64_t m,
          int64_t r0, int64_t r1) {
    const int64_t ng = groups(w.n);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w.packed + r * w.row_bytes;
        const int8_t* lv = w.levels + 16 * r;
        for (int64_t b = 0; b < m; ++b) {
            const int8_t* qb = q + b * w.n;
            float t = 0.f;
            for (int64_t g = 0; g < ng; ++g) {
                int32_t acc = 0;
                for (int64_t c = g * GROUP; c < w.n && c < (g + 1) * GROUP; ++c)
                    acc += (int32_t)lv[code_at(row, c, w.bits)] * qb[c];
                t = t + (float)acc * sx[b * ng + g];
            }
            y[b * w.rows + r] = finish(w, r, t, x + b * w.n, bias);
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

// the chunk at p (32 bytes at 4 bits, 24 at 3) looked up in tbl: v[0] plane 0, v[1] plane 1
inline void chunk(const uint8_t* p, int bits, __m256i tbl, __m256i* v) {
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
    const uint8_t* row = w.packed + r * w.row_bytes;
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(w.levels + 16 * r)));
    alignas(32) uint8_t buf[32];
    for (int64_t k = 0; k < groups(w.n); ++k) {
        __m256i v[2];
        chunk(chunk_ptr(row, w.row_bytes, k, w.bits, buf), w.bits, tbl, v);
        for (int i = 0; i < 2; ++i) {
            _mm256_storeu_si256((__m256i*)(out + GROUP * k + 32 * i), v[i]);
            _mm256_storeu_si256((__m256i*)(mag + GROUP * k + 32 * i), _mm256_abs_epi8(v[i]));
        }
    }
}

inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// t[4 * b + i] = the groups' float32 sum (header comment) for 4 panel rows and MB activation rows
template <int MB>
void tile(const int8_t* w, const uint8_t* mag, int64_t np, const int8_t* q, const float* sx, float* t) {
    const int64_t ng = np / GROUP;
    float tt[MB][4];
    for (int b = 0; b < MB; ++b)
        for (int i = 0; i < 4; ++i) tt[b][i] = 0.f;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ng; ++g) {
        __m256i a[4][MB];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
            for (int b = 0; b < MB; ++b) a[i][b] = _mm256_setzero_si256();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 32) {
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
            for (int i = 0; i < 4; ++i) tt[b][i] = tt[b][i] + (float)hsum(a[i][b]) * sx[b * ng + g];
    }
    for (int b = 0; b < MB; ++b)
        for (int i = 0; i < 4; ++i) t[4 * b + i] = tt[b][i];
}

}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: the OUTER-product form (header comment). No horizontal sums: each group's 16 row sums come out
// as one vector, and the float32 steps run 16 rows at a time.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")
namespace avx512 {

void quantize_one(const float* xr, int64_t n, int bits, int8_t* nat, int8_t* out, float* sx, int32_t* sumq) {
    quantize_row(xr, n, bits, nat, out, sx, sumq);
}

// chunk k of rows[0..15] (tables tbl[i]: their levels + 128) decoded and transposed into tp (16 vectors: vector j
// holds bytes 4j .. 4j+3 of the chunk's 64 decoded bytes for each of the 16 rows), straight from registers
inline void transpose16(const __m512i* r, __m512i* out);
inline void decode_chunk16(const sq_w8& w, const uint8_t* const* rows, const __m256i* tbl, int64_t k, uint8_t* tp) {
    alignas(32) uint8_t buf[32];
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) {
        __m256i v[2];
        avx2::chunk(chunk_ptr(rows[i], w.row_bytes, k, w.bits, buf), w.bits, _mm256_load_si256(tbl + i), v);
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
    }
    transpose16(r, t);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(tp + 64 * j, t[j]);
}

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

// acc += u8 w . s8 (4 bytes at x, broadcast to every dword); the asm form keeps GCC 12 from copying the
// accumulator around each instruction
inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
    return acc;
}

// t[b] (16 rows) = the groups' float32 sum for MB activation rows from the transposed panel tp
template <int MB>
inline void block(const uint8_t* tp, int64_t np, const int8_t* q, const float* sx, const int32_t* sumq, __m512* t) {
    const int64_t ng = np / GROUP;
#pragma GCC unroll 8
    for (int b = 0; b < MB; ++b) t[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        __m512i a[MB];  // started at -128 * sum(q): the +128 of the weights' uint8 form cancels as the sums run
#pragma GCC unroll 8
        for (int b = 0; b < MB; ++b) a[b] = _mm512_set1_epi32(-128 * sumq[b * ng + g]);
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 4) {
            const __m512i wv = _mm512_load_si512(tp + 16 * k);
#pragma GCC unroll 8
            for (int b = 0; b < MB; ++b) a[b] = dpbusd_bcst(a[b], wv, q + b * np + k);
        }
#pragma GCC unroll 8
        for (int b = 0; b < MB; ++b)
            t[b] = _mm512_add_ps(t[b], _mm512_mul_ps(_mm512_cvtepi32_ps(a[b]), _mm512_set1_ps(sx[b * ng + g])));
    }
}

// the 16 lane sums of each of a[0..15], as the 16 lanes of one vector (integer: any order gives the same sums)
inline __m512i reduce16(const __m512i* a) {
    __m512i v[4];
    for (int q = 0; q < 4; ++q) {  // rows 4q .. 4q+3: each 128-bit lane holds their partial sums
        const __m512i* r = a + 4 * q;
        const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(r[0], r[1]), _mm512_unpackhi_epi32(r[0], r[1]));
        const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(r[2], r[3]), _mm512_unpackhi_epi32(r[2], r[3]));
        v[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    }
    const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x44), _mm512_shuffle_i32x4(v[0], v[1], 0xEE));
    const __m512i cd = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x44), _mm512_shuffle_i32x4(v[2], v[3], 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(ab, cd, 0x88), _mm512_shuffle_i32x4(ab, cd, 0xDD));
}

// block<1> for one activation row without the transposed panel: each decoded 64-byte chunk of the 16 rows
// meets the row's 64 quantized bytes in one vpdpbusd, and reduce16 gives the 16 rows' group sums (the same
// integers, then the same float32 steps: the same bits as block<1>)
inline void direct1(const sq_w8& w, const uint8_t* const* rows, const __m256i* tbl, int64_t ng, const int8_t* q,
                    const float* sx, const int32_t* sumq, __m512* t) {
    alignas(32) uint8_t buf[32];
    *t = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        const __m512i xv = _mm512_loadu_si512(q + GROUP * g);
        __m512i a[16];
        for (int i = 0; i < 16; ++i) {
            __m256i v[2];
            avx2::chunk(chunk_ptr(rows[i], w.row_bytes, g, w.bits, buf), w.bits, _mm256_load_si256(tbl + i), v);
            a[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1), xv);
        }
        const __m512i acc = _mm512_sub_epi32(reduce16(a), _mm512_set1_epi32(128 * sumq[g]));
        *t = _mm512_add_ps(*t, _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sx[g])));
    }
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
struct Call {
    const sq_w8* w;
    const int8_t* q;  // (m, np) laid out
    const float* sx;  // (m, groups)
    const int32_t* sumq;
    const float* x;
    const float* bias;
    float* y;
    int64_t m;
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")
// weight rows [r0, r1) of one task, 16 at a time (rows past r1 repeat the last one and are dropped)
void avx512_rows(const Call& c, int64_t r0, int64_t r1) {
    const sq_w8& w = *c.w;
    const int64_t np = padded(w.n), ng = groups(w.n);
    static thread_local std::vector<uint8_t> buf;
    if ((int64_t)buf.size() < 16 * np + 64) buf.resize((size_t)(16 * np + 64));
    uint8_t* tp = (uint8_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);  // (np / 4, 16) dwords: the panel
    for (int64_t g = r0; g < r1; g += 16) {
        const int live = r1 - g < 16 ? (int)(r1 - g) : 16;
        const uint8_t* rows[16];
        alignas(32) __m256i tbl[16];
        for (int i = 0; i < 16; ++i) {
            const int64_t r = g + (i < live ? i : live - 1);
            rows[i] = w.packed + r * w.row_bytes;
            tbl[i] = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(w.levels + 16 * r))),
                                      _mm256_set1_epi8((char)0x80));
        }
        if (c.m > 1)
            for (int64_t k = 0; k < ng; ++k) avx512::decode_chunk16(w, rows, tbl, k, tp + 16 * GROUP * k);
        const __mmask16 mask = (__mmask16)((1u << live) - 1);
        const __m512 sw = _mm512_maskz_loadu_ps(mask, w.scale + g);
        const __m512 bias = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + g) : _mm512_setzero_ps();
        const bool sparse = w.rowptr && w.rowptr[g + live] > w.rowptr[g];
        for (int64_t b0 = 0; b0 < c.m; b0 += 8) {
            const int mb = c.m - b0 < 8 ? (int)(c.m - b0) : 8;
            const int8_t* qb = c.q + b0 * np;
            const float* sxb = c.sx + b0 * ng;
            const int32_t* sqb = c.sumq + b0 * ng;
            __m512 t[8];
            switch (c.m == 1 ? 0 : mb) {
                case 0: avx512::direct1(w, rows, tbl, ng, qb, sxb, sqb, t); break;
                case 1: avx512::block<1>(tp, np, qb, sxb, sqb, t); break;
                case 2: avx512::block<2>(tp, np, qb, sxb, sqb, t); break;
                case 3: avx512::block<3>(tp, np, qb, sxb, sqb, t); break;
                case 4: avx512::block<4>(tp, np, qb, sxb, sqb, t); break;
                case 5: avx512::block<5>(tp, np, qb, sxb, sqb, t); break;
                case 6: avx512::block<6>(tp, np, qb, sxb, sqb, t); break;
                case 7: avx512::block<7>(tp, np, qb, sxb, sqb, t); break;
                default: avx512::block<8>(tp, np, qb, sxb, sqb, t); break;
            }
            for (int b = 0; b < mb; ++b) {  // finish() for 16 rows: the same IEEE operations in the same order
                const int64_t row = b0 + b;
                __m512 y = _mm512_mul_ps(t[b], sw);
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
#pragma GCC pop_options

// AVX2: weight rows decoded 4 at a time, each group of 4 multiplied by every activation row, 2 at a time
void avx2_rows(const Call& c, int64_t r0, int64_t r1) {
    const sq_w8& w = *c.w;
    const int64_t np = padded(w.n), ng = groups(w.n);
    static thread_local std::vector<uint8_t> panel;
    if ((int64_t)panel.size() < 8 * np) panel.resize((size_t)(8 * np));
    int8_t* pw = (int8_t*)panel.data();
    uint8_t* pm = panel.data() + 4 * np;
    float t[8];
    for (int64_t g = r0; g < r1; g += 4) {
        const int64_t live = r1 - g < 4 ? r1 - g : 4;
        for (int i = 0; i < 4; ++i) avx2::decode_row(w, g + (i < live ? i : live - 1), pw + i * np, pm + i * np);
        for (int64_t b0 = 0; b0 < c.m; b0 += 2) {
            const int mb = c.m - b0 < 2 ? (int)(c.m - b0) : 2;
            if (mb == 1)
                avx2::tile<1>(pw, pm, np, c.q + b0 * np, c.sx + b0 * ng, t);
            else
                avx2::tile<2>(pw, pm, np, c.q + b0 * np, c.sx + b0 * ng, t);
            for (int b = 0; b < mb; ++b)
                for (int64_t i = 0; i < live; ++i)
                    c.y[(b0 + b) * w.rows + g + i] = finish(w, g + i, t[4 * b + i], c.x + (b0 + b) * w.n, c.bias);
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
    const int64_t np = padded(w.n), ng = groups(w.n), width = simd ? np : w.n;
    static thread_local std::vector<int8_t> q;
    static thread_local std::vector<float> sx;
    static thread_local std::vector<int32_t> sumq;
    if ((int64_t)q.size() < m * width) q.resize((size_t)(m * width));
    if ((int64_t)sx.size() < m * ng) {
        sx.resize((size_t)(m * ng));
        sumq.resize((size_t)(m * ng));
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
                    scalar::quantize_one(xr, n, bits, qd + b * n, nullptr, sxd + b * ng, sd + b * ng);
                else if (isa == ISA_AVX512)
                    avx512::quantize_one(xr, n, bits, nat.data(), qd + b * np, sxd + b * ng, sd + b * ng);
                else
                    avx2::quantize_one(xr, n, bits, nat.data(), qd + b * np, sxd + b * ng, sd + b * ng);
            }
        }
    }
    // small products run on the calling thread: waking the others costs microseconds
    if (w.rows * w.row_bytes * (m < 8 ? m : 8) < (64 << 10)) threads = 1;
    const int64_t g = 16, tasks = (w.rows + g - 1) / g;
    // the calling thread's buffers, by pointer (inside the parallel loop `q` would name each thread's own)
    const Call c{&w, q.data(), sx.data(), sumq.data(), x, bias, y, m};
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1 && threads > 1)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t r0 = t * g, r1 = r0 + g < w.rows ? r0 + g : w.rows;
        if (simd && isa == ISA_AVX512)
            avx512_rows(c, r0, r1);
        else if (simd)
            avx2_rows(c, r0, r1);
        else
            scalar::rows(w, c.q, c.sx, x, y, bias, m, r0, r1);
    }
}

}  // extern "C"
