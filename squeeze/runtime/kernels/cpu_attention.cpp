// squeeze native CPU attention over a quantized (int8 / int4 / codebook / fp8) or full-precision KV history.
//
// One call per attention layer for a whole ragged step: row b owns queries q_offsets[b]..q_offsets[b+1]
// of the step's N tokens and keys k_offsets[b]..k_offsets[b+1] of the step's K history tokens (its whole
// history, from position 0). Query i of a row of n queries and L keys sits at position L - n + i and sees
// keys key_start[b] .. L - n + i (causal, aligned at the row's end; key_start skips left padding).
// History token p of row b lives at token slot slots[k_offsets[b] + p] of the layer's stores, or, when
// sink_of[k_offsets[b] + p] >= 0, at that entry of the full-precision sink area.
//
// Work is split into tasks of (row, kv head, block of queries); the query heads of one kv head are done
// together, so every K/V tile is dequantized once (into a small L1 buffer, never the whole history) for
// all of them. Each query runs its own online softmax over tiles of TILE tokens aligned at position 0, in
// order: a query's result depends only on its own row's data, never on the other rows, the query blocks,
// the thread count or the instruction set. Every reduction is sequential (over channels for a score,
// over tokens for the softmax sum and the output), and with -ffp-contract=off the scalar, AVX2 and
// AVX-512 builds of the same code give the same bits.
//
// The body below is compiled three times (this file includes itself), once per instruction set.

#ifndef SQ_ATTN_BODY
#define SQ_ATTN_BODY 1

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {

// Keys or values of one layer (see cpu_attention.py: SqKV).
struct sq_kv {
    const void* codes;        // kind F32: float [..][D]; else bytes, D (8-bit) or D/2 (4-bit) per token and head
    const uint16_t* scale;    // fp16 per token, head and grid; null: const_scale for every element
    const uint16_t* offset;   // fp16 like scale (asymmetric grids), or null
    const float* table;       // code -> level: 256 entries (T8) or 16 (T4); null otherwise
    const float* ch_scale;    // [H][D] key normaliser scale, or null
    const float* ch_center;   // key normaliser centre (with ch_scale): [H][D], or [H][center_rows][D] by position
    const float* sink;        // float [..][D] full-precision sink area, or null
    int64_t head_stride;      // token slots between two heads of codes / scale / offset
    int64_t sink_head_stride; // sink entries between two heads
    int64_t center_rows;      // 0: one centre per head; else a rotating centre's rows, row p for cache position p
    float const_scale;
    int32_t kind;             // SQ_KV_* below
    int32_t groups;           // grids (scales) per token and head
};
}

enum { SQ_SCALAR = 0, SQ_AVX2 = 1, SQ_AVX512 = 2 };
enum { SQ_KV_F32 = 0, SQ_KV_I8 = 1, SQ_KV_U8 = 2, SQ_KV_I4 = 3, SQ_KV_U4 = 4, SQ_KV_T8 = 5, SQ_KV_T4 = 6 };

namespace {

constexpr int TILE = 16;         // history tokens per tile (fixed: part of every query's reduction order)
constexpr int QUERY_BLOCK = 16;  // queries (of one row) per task

struct Args {
    const float* q;
    int32_t hq, hkv, d;
    float scaling;
    const int64_t* q_offsets;
    const int64_t* k_offsets;
    const int64_t* key_start;
    const int64_t* slots;
    const int64_t* sink_of;
    const sq_kv* keys;
    const sq_kv* values;
    float* out;
};

struct Task {
    int64_t row, i0, i1;
    int32_t head;
};

inline float half_to_float(uint16_t h) {
    // IEEE fp16 -> fp32, exact (subnormals, infinities and NaN included)
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        int e = -1;
        do {
            mant <<= 1;
            ++e;
        } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace

// shuffle masks of transpose_block's rounds, per vector width W (lanes 0..W-1: the upper row of a pair,
// W..2W-1: the lower one), for the swap of off-diagonal blocks of b lanes: SQ_L{W}_{b} / SQ_H{W}_{b}
#define SQ_L16_8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define SQ_H16_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define SQ_L16_4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define SQ_H16_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SQ_L16_2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define SQ_H16_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SQ_L16_1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define SQ_H16_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define SQ_L8_4 0, 1, 2, 3, 8, 9, 10, 11
#define SQ_H8_4 4, 5, 6, 7, 12, 13, 14, 15
#define SQ_L8_2 0, 1, 8, 9, 4, 5, 12, 13
#define SQ_H8_2 2, 3, 10, 11, 6, 7, 14, 15
#define SQ_L8_1 0, 8, 2, 10, 4, 12, 6, 14
#define SQ_H8_1 1, 9, 3, 11, 5, 13, 7, 15
#define SQ_L4_2 0, 1, 4, 5
#define SQ_H4_2 2, 3, 6, 7
#define SQ_L4_1 0, 4, 2, 6
#define SQ_H4_1 1, 5, 3, 7

#define SQ_ATTN_NS scalar
#define SQ_W 4
#include "cpu_attention.cpp"  // the body again (this file, found beside itself)
#undef SQ_W
#undef SQ_ATTN_NS

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SQ_ATTN_NS avx2
#define SQ_W 8
#include "cpu_attention.cpp"  // the body again (this file, found beside itself)
#undef SQ_W
#undef SQ_ATTN_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define SQ_ATTN_NS avx512
#define SQ_W 16
#include "cpu_attention.cpp"  // the body again (this file, found beside itself)
#undef SQ_W
#undef SQ_ATTN_NS
#pragma GCC pop_options

namespace {

using task_fn = void (*)(const Args&, const Task&, float*);

task_fn task_for(int isa, int d) {
    if (isa == SQ_AVX512) return d == 64 ? avx512::run_task<64> : d == 128 ? avx512::run_task<128> : avx512::run_task<0>;
    if (isa == SQ_AVX2) return d == 64 ? avx2::run_task<64> : d == 128 ? avx2::run_task<128> : avx2::run_task<0>;
    return d == 64 ? scalar::run_task<64> : d == 128 ? scalar::run_task<128> : scalar::run_task<0>;
}

}  // namespace

extern "C" {

// 1 when this CPU runs `isa`
int sq_isa_supported(int isa) {
    if (isa == SQ_SCALAR) return 1;
    __builtin_cpu_init();
    if (isa == SQ_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == SQ_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return 0;
}

// Attention of every row of a step (see the top of this file). q: float (N, hq, d), already rotated;
// out: float (N, hq, d). q_offsets / k_offsets: (rows + 1,); key_start: (rows,) or null; slots / sink_of:
// (K,) (sink_of may be null). threads <= 0: OpenMP's default.
void sq_attention(const float* q, int32_t hq, int32_t hkv, int32_t d, float scaling, int64_t rows,
                  const int64_t* q_offsets, const int64_t* k_offsets, const int64_t* key_start,
                  const int64_t* slots, const int64_t* sink_of, const sq_kv* keys, const sq_kv* values,
                  float* out, int32_t isa, int32_t threads) {
    Args a{q, hq, hkv, d, scaling, q_offsets, k_offsets, key_start, slots, sink_of, keys, values, out};
    std::vector<Task> tasks;
    for (int64_t b = 0; b < rows; ++b) {
        int64_t n = q_offsets[b + 1] - q_offsets[b];
        for (int64_t i0 = 0; i0 < n; i0 += QUERY_BLOCK)
            for (int32_t h = 0; h < hkv; ++h) tasks.push_back({b, i0, i0 + QUERY_BLOCK < n ? i0 + QUERY_BLOCK : n, h});
    }
    task_fn fn = task_for(isa, d);
    int64_t count = (int64_t)tasks.size();
    int nthreads = threads > 0 ? threads : omp_get_max_threads();
    if (nthreads > count) nthreads = count > 0 ? (int)count : 1;
    // per thread: queries, accumulators and maxima/sums of one task, plus one K and one V tile
    size_t per_thread = 3 * (size_t)TILE * d + d + (size_t)QUERY_BLOCK * (hq / hkv) * (2 * d + TILE + 1) + 64;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> work(per_thread + 16);
        float* aligned = (float*)(((uintptr_t)work.data() + 63) & ~(uintptr_t)63);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < count; ++t) fn(a, tasks[t], aligned);
    }
}

}  // extern "C"

#else  // the per-instruction-set body, included once per SQ_ATTN_NS

namespace {
namespace SQ_ATTN_NS {

// SQ_W lanes: the instruction set's own width (GCC's generic vectors: one register each)
constexpr int W = SQ_W;
constexpr int NV = TILE / W;  // vectors per tile of scores
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef float vf_u __attribute__((vector_size(W * 4), aligned(4)));  // for unaligned loads / stores

__attribute__((always_inline)) inline vf load(const float* p) { return *(const vf_u*)p; }
__attribute__((always_inline)) inline void store(float* p, vf v) { *(vf_u*)p = v; }

// exp(x) per lane, x <= 0 (Cody-Waite reduction and Cephes' polynomial, about 1 ulp); lanes below -87 give 0.
// Plain elementwise float ops: every instruction set computes the same bits.
__attribute__((always_inline)) inline vf expv(vf x) {
    const vi under = x < -87.0f;
    x = under ? (vf){} - 87.0f : x;
    vf t = x * 1.44269504088896341f - 0.5f;  // x <= 0: truncation of t rounds x * log2(e) to nearest
    vi n = __builtin_convertvector(t, vi);
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    vf p = (vf){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * (r * r) + r + 1.0f;
    vi bits = (n + 127) << 23;
    y = y * (vf)bits;
    return under ? (vf){} : y;
}

__attribute__((always_inline)) inline float exp1(float x) { return expv((vf){} + x)[0]; }

#if SQ_W == 16
const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif SQ_W == 8
const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7};
#else
const vi lanes = {0, 1, 2, 3};
#endif

// the largest lane (exact: the order of a max does not matter)
__attribute__((always_inline)) inline float hmax(vf v) {
#define SQ_MAX(...)                                            \
    {                                                          \
        const vf other = __builtin_shufflevector(v, v, __VA_ARGS__); \
        v = v > other ? v : other;                             \
    }
#if SQ_W == 16
    SQ_MAX(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
    SQ_MAX(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
    SQ_MAX(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
    SQ_MAX(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#elif SQ_W == 8
    SQ_MAX(4, 5, 6, 7, 0, 1, 2, 3)
    SQ_MAX(2, 3, 0, 1, 6, 7, 4, 5)
    SQ_MAX(1, 0, 3, 2, 5, 4, 7, 6)
#else
    SQ_MAX(2, 3, 0, 1)
    SQ_MAX(1, 0, 3, 2)
#endif
#undef SQ_MAX
    return v[0];
}

// The W nibbles of W/2 packed bytes as int32 lanes in channel order (low nibble first), sign-extended when
// `sign` (exact integer work: every instruction set gives the same lanes).
__attribute__((always_inline)) inline vi nibbles(const uint8_t* c, bool sign) {
#if SQ_W == 16
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)c);                     // 8 bytes
    const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));     // each byte twice
    const __m512i up = _mm512_set_epi32(24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28);
    const __m512i top = _mm512_sllv_epi32(v, up);  // the lane's nibble in bits 28..31
    return (vi)(sign ? _mm512_srai_epi32(top, 28) : _mm512_srli_epi32(top, 28));
#elif SQ_W == 8
    int32_t word;
    std::memcpy(&word, c, 4);
    const __m128i bytes = _mm_cvtsi32_si128(word);
    const __m256i v = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
    const __m256i up = _mm256_set_epi32(24, 28, 24, 28, 24, 28, 24, 28);
    const __m256i top = _mm256_sllv_epi32(v, up);
    return (vi)(sign ? _mm256_srai_epi32(top, 28) : _mm256_srli_epi32(top, 28));
#else
    vi v;
    for (int l = 0; l < W; ++l) {
        const int32_t top = (int32_t)((uint32_t)c[l / 2] << ((l & 1) ? 24 : 28));
        v[l] = sign ? top >> 28 : (int32_t)((uint32_t)top >> 28);
    }
    return v;
#endif
}

// r[0..W) <- their transpose (W x W floats): rounds that swap the off-diagonal blocks of W/2, ..., 1 lanes
__attribute__((always_inline)) inline void transpose_block(vf* r) {
#define SQ_SWAP(B, LO, HI)                                         \
    for (int i = 0; i < W; ++i)                                     \
        if (!(i & B)) {                                             \
            const vf a = r[i], b = r[i + B];                        \
            r[i] = __builtin_shufflevector(a, b, LO);               \
            r[i + B] = __builtin_shufflevector(a, b, HI);           \
        }
#if SQ_W == 16
    SQ_SWAP(8, SQ_L16_8, SQ_H16_8)
    SQ_SWAP(4, SQ_L16_4, SQ_H16_4)
    SQ_SWAP(2, SQ_L16_2, SQ_H16_2)
    SQ_SWAP(1, SQ_L16_1, SQ_H16_1)
#elif SQ_W == 8
    SQ_SWAP(4, SQ_L8_4, SQ_H8_4)
    SQ_SWAP(2, SQ_L8_2, SQ_H8_2)
    SQ_SWAP(1, SQ_L8_1, SQ_H8_1)
#else
    SQ_SWAP(2, SQ_L4_2, SQ_H4_2)
    SQ_SWAP(1, SQ_L4_1, SQ_H4_1)
#endif
#undef SQ_SWAP
}

// Token p of `row` of head h, dequantized into dst[0..D): as squeeze's TokenCodec.decode_into computes it
// (code or level times the grid's scale, plus its offset; keys then times the normaliser's scale plus its
// centre, the rotating centre added to the centre first), or the sink token as stored.
template <int DF>
inline void load_token(const Args& a, const sq_kv& kv, int h, int64_t index, int64_t p, float* dst) {
    const int D = DF ? DF : a.d;
    int64_t sink = a.sink_of ? a.sink_of[index] : -1;
    if (sink >= 0) {
        const float* src = kv.sink + (h * kv.sink_head_stride + sink) * (int64_t)D;
        for (int c = 0; c < D; ++c) dst[c] = src[c];
        return;
    }
    int64_t token = h * kv.head_stride + a.slots[index];
    if (kv.kind == SQ_KV_F32) {
        const float* src = (const float*)kv.codes + token * D;
        for (int c = 0; c < D; ++c) dst[c] = src[c];
        return;
    }
    const int G = kv.groups, gs = D / G;
    const bool packed = kv.kind == SQ_KV_I4 || kv.kind == SQ_KV_U4 || kv.kind == SQ_KV_T4;
    const uint8_t* codes = (const uint8_t*)kv.codes + token * (packed ? D / 2 : D);
    for (int g = 0; g < G; ++g) {
        float s = kv.scale ? half_to_float(kv.scale[token * G + g]) : kv.const_scale;
        float* o = dst + g * gs;
        const uint8_t* c = codes + (packed ? g * gs / 2 : g * gs);
        switch (kv.kind) {
            case SQ_KV_I8:
                for (int i = 0; i < gs; ++i) o[i] = (float)(int8_t)c[i] * s;
                break;
            case SQ_KV_U8:
                for (int i = 0; i < gs; ++i) o[i] = (float)c[i] * s;
                break;
            case SQ_KV_I4:
            case SQ_KV_U4:
                if (gs % W == 0) {
                    for (int i = 0; i < gs; i += W)
                        store(o + i, __builtin_convertvector(nibbles(c + i / 2, kv.kind == SQ_KV_I4), vf) * s);
                } else if (kv.kind == SQ_KV_I4) {
                    for (int i = 0; i < gs / 2; ++i) {
                        o[2 * i] = (float)((int8_t)(uint8_t)(c[i] << 4) >> 4) * s;
                        o[2 * i + 1] = (float)((int8_t)c[i] >> 4) * s;
                    }
                } else {
                    for (int i = 0; i < gs / 2; ++i) {
                        o[2 * i] = (float)(c[i] & 0x0f) * s;
                        o[2 * i + 1] = (float)(c[i] >> 4) * s;
                    }
                }
                break;
            case SQ_KV_T8:
                for (int i = 0; i < gs; ++i) o[i] = kv.table[c[i]] * s;
                break;
            case SQ_KV_T4:
#if SQ_W == 16
                if (gs % W == 0) {  // the 16 levels are one register: a lane permutation looks them up
                    const vf levels = load(kv.table);
                    for (int i = 0; i < gs; i += W) store(o + i, __builtin_shuffle(levels, nibbles(c + i / 2, false)) * s);
                    break;
                }
#elif SQ_W == 8
                if (gs % W == 0) {  // the 16 levels are two registers
                    const vf lo = load(kv.table), hi = load(kv.table + 8);
                    for (int i = 0; i < gs; i += W)
                        store(o + i, __builtin_shuffle(lo, hi, nibbles(c + i / 2, false)) * s);
                    break;
                }
#endif
                for (int i = 0; i < gs / 2; ++i) {
                    o[2 * i] = kv.table[c[i] & 0x0f] * s;
                    o[2 * i + 1] = kv.table[c[i] >> 4] * s;
                }
                break;
        }
        if (kv.offset) {
            float z = half_to_float(kv.offset[token * G + g]);
            for (int i = 0; i < gs; ++i) o[i] = o[i] + z;
        }
    }
    if (kv.ch_scale) {
        const float* cs = kv.ch_scale + h * (int64_t)D;
        const float* cz = kv.ch_center + (kv.center_rows ? h * kv.center_rows + p : h) * (int64_t)D;
        for (int c = 0; c < D; ++c) dst[c] = cz[c] + dst[c] * cs[c];
    }
}

template <int DF>
void run_task(const Args& a, const Task& task, float* work) {
    const int D = DF ? DF : a.d;
    const int G = a.hq / a.hkv;
    const int64_t b = task.row, k0 = a.k_offsets[b];
    const int64_t n = a.q_offsets[b + 1] - a.q_offsets[b], L = a.k_offsets[b + 1] - k0;
    const int64_t ks = a.key_start ? a.key_start[b] : 0;
    const int nq = (int)(task.i1 - task.i0) * G;
    float* kt = work;                    // [D][TILE] keys, transposed (work is 64-byte aligned)
    float* vt = kt + (size_t)D * TILE;   // [TILE][D]
    float* kr = vt + (size_t)D * TILE;   // [TILE][D] keys as decoded, before the transposition
    float* tok = kr + (size_t)D * TILE;  // [D] one token
    float* qs = tok + D;                 // [nq][D] scaled queries
    float* acc = qs + (size_t)nq * D;    // [nq][D]
    float* sum = acc + (size_t)nq * D;   // [nq][TILE]
    float* mx = sum + (size_t)nq * TILE; // [nq]
    for (int64_t i = task.i0; i < task.i1; ++i)
        for (int g = 0; g < G; ++g) {
            int qi = (int)(i - task.i0) * G + g;
            const float* src = a.q + ((a.q_offsets[b] + i) * a.hq + task.head * G + g) * (int64_t)D;
            for (int c = 0; c < D; ++c) qs[qi * D + c] = src[c] * a.scaling;
            for (int c = 0; c < D; ++c) acc[qi * D + c] = 0.0f;
            mx[qi] = -INFINITY;
            for (int j = 0; j < TILE; ++j) sum[qi * TILE + j] = 0.0f;
        }
    const int64_t last = L - n + task.i1 - 1;  // the last key any query of the task sees
    for (int64_t t0 = (ks / TILE) * TILE; t0 <= last; t0 += TILE) {
        const int cnt = (int)((last + 1 - t0) < TILE ? (last + 1 - t0) : TILE);
        if (D % W == 0) {
            // keys row by row, then each W x W block transposed (exact: only moves)
            for (int j = 0; j < cnt; ++j) load_token<DF>(a, *a.keys, task.head, k0 + t0 + j, t0 + j, kr + j * D);
            for (int j = cnt; j < TILE; ++j)
                for (int c = 0; c < D; ++c) kr[j * D + c] = 0.0f;
            for (int k = 0; k < D / W; ++k)
                for (int u = 0; u < NV; ++u) {
                    vf block[W];
                    for (int j = 0; j < W; ++j) block[j] = load(kr + (u * W + j) * D + k * W);
                    transpose_block(block);
                    for (int c = 0; c < W; ++c) store(kt + (k * W + c) * TILE + u * W, block[c]);
                }
        } else {
            for (int j = 0; j < cnt; ++j) {
                load_token<DF>(a, *a.keys, task.head, k0 + t0 + j, t0 + j, tok);
                for (int c = 0; c < D; ++c) kt[c * TILE + j] = tok[c];
            }
            for (int j = cnt; j < TILE; ++j)
                for (int c = 0; c < D; ++c) kt[c * TILE + j] = 0.0f;
        }
        for (int j = 0; j < cnt; ++j) load_token<DF>(a, *a.values, task.head, k0 + t0 + j, t0 + j, vt + j * D);
        for (int64_t i = task.i0; i < task.i1; ++i) {
            const int64_t pos = L - n + i;
            const int lo = (int)((ks > t0 ? ks : t0) - t0);
            const int hi = (int)((pos + 1 < t0 + cnt ? pos + 1 : t0 + cnt) - t0);
            if (hi <= lo) continue;
            for (int g = 0; g < G; ++g) {
                const int qi = (int)(i - task.i0) * G + g;
                const float* qv = qs + qi * D;
                // the scores of the tile's keys: four partial sums over the channels (c mod 4), added in a
                // fixed order: independent chains for the pipeline, the same bits on every instruction set
                vf s0[NV], s1[NV], s2[NV], s3[NV];
                for (int u = 0; u < NV; ++u) s0[u] = s1[u] = s2[u] = s3[u] = (vf){};
                int c = 0;
                for (; c + 4 <= D; c += 4)
                    for (int u = 0; u < NV; ++u) {
                        s0[u] = s0[u] + qv[c] * load(kt + c * TILE + u * W);
                        s1[u] = s1[u] + qv[c + 1] * load(kt + (c + 1) * TILE + u * W);
                        s2[u] = s2[u] + qv[c + 2] * load(kt + (c + 2) * TILE + u * W);
                        s3[u] = s3[u] + qv[c + 3] * load(kt + (c + 3) * TILE + u * W);
                    }
                for (; c < D; ++c)
                    for (int u = 0; u < NV; ++u) s0[u] = s0[u] + qv[c] * load(kt + c * TILE + u * W);
                // the keys this query sees: lanes lo..hi-1 of the tile
                vf sc[NV];
                vi seen[NV];
                vf best = (vf){} - INFINITY;
                for (int u = 0; u < NV; ++u) {
                    const vi index = lanes + u * W;
                    seen[u] = (index >= lo) & (index < hi);
                    sc[u] = (s0[u] + s1[u]) + (s2[u] + s3[u]);
                    const vf masked = seen[u] ? sc[u] : (vf){} - INFINITY;
                    best = best > masked ? best : masked;
                }
                const float m = hmax(best);  // exact in any order
                float* o = acc + qi * D;
                float* ls = sum + qi * TILE;  // the softmax sum, one partial per lane
                if (m > mx[qi]) {
                    const float corr = exp1(mx[qi] - m);  // 0 on the first visible tile
                    for (int u = 0; u < NV; ++u) store(ls + u * W, load(ls + u * W) * corr);
                    for (int c2 = 0; c2 < D; ++c2) o[c2] = o[c2] * corr;
                    mx[qi] = m;
                }
                float ev[TILE];  // lanes through memory: one store, not one extraction per lane
                for (int u = 0; u < NV; ++u) {
                    const vf e = seen[u] ? expv(sc[u] - mx[qi]) : (vf){};
                    store(ev + u * W, e);
                    store(ls + u * W, load(ls + u * W) + e);
                }
                if (DF > 0 && DF % W == 0) {  // the output row in registers across the tile
                    constexpr int NO = DF > 0 && DF % W == 0 ? DF / W : 1;
                    vf ov[NO];
                    for (int k = 0; k < NO; ++k) ov[k] = load(o + W * k);
                    for (int j = lo; j < hi; ++j) {
                        const float pj = ev[j];
                        const float* v = vt + j * D;
                        for (int k = 0; k < NO; ++k) ov[k] = ov[k] + pj * load(v + W * k);
                    }
                    for (int k = 0; k < NO; ++k) store(o + W * k, ov[k]);
                } else {
                    for (int j = lo; j < hi; ++j) {
                        const float pj = ev[j];
                        const float* v = vt + j * D;
                        for (int c2 = 0; c2 < D; ++c2) o[c2] = o[c2] + pj * v[c2];
                    }
                }
            }
        }
    }
    for (int64_t i = task.i0; i < task.i1; ++i)
        for (int g = 0; g < G; ++g) {
            const int qi = (int)(i - task.i0) * G + g;
            float* dst = a.out + ((a.q_offsets[b] + i) * a.hq + task.head * G + g) * (int64_t)D;
            float l = 0.0f;
            for (int j = 0; j < TILE; ++j) l = l + sum[qi * TILE + j];  // the lanes' partial sums, in order
            // a query that sees no key (a left-padding position) gets zeros, not 0/0
            for (int c = 0; c < D; ++c) dst[c] = l > 0.0f ? acc[qi * D + c] / l : 0.0f;
        }
}

}  // namespace SQ_ATTN_NS
}  // namespace

#endif
