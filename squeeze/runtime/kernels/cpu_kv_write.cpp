// squeeze native KV write: a step's new keys or values quantized straight into a layer's stores, the bytes
// squeeze.runtime.kv_codecs.TokenCodec.encode writes (int8 / packed int4 uniform grids, symmetric or not, the
// 16- or 256-level codebook, with the key normaliser and its rotating centre), for the stores the attention
// kernel (cpu_attention.cpp) reads. Linked into the attention library.
//
// Bit-exactness with the torch codec: every step is the float32 operation torch performs, in its order
// (normalise (x - centre) / scale; per grid of g channels the absmax or min / max; the grid's scale and offset
// rounded to fp16 round-to-nearest-even, as Tensor.half() does; codes by nearbyint (torch.round: half to
// even) and clamp, or for a codebook the count of level midpoints strictly below x / scale, as
// torch.bucketize(right=False) counts). Compiled with -ffp-contract=off (no fused multiply-adds) and without
// fast-math, so each operation rounds once, like torch's. Scalar code: a step writes N x H x D elements, which
// is small next to its attention.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

struct sq_kv_view {  // cpu_attention.cpp's sq_kv, the fields read here
    void* codes;
    uint16_t* scale;
    uint16_t* offset;
    const float* table;
    const float* ch_scale;
    const float* ch_center;
    const float* sink;
    int64_t head_stride;
    int64_t sink_head_stride;
    int64_t center_rows;
    float const_scale;
    int32_t kind;
    int32_t groups;
};

enum { KV_I8 = 1, KV_U8 = 2, KV_I4 = 3, KV_U4 = 4, KV_T8 = 5, KV_T4 = 6 };

// fp32 -> fp16 bits, round to nearest even (overflow to infinity, subnormals kept), as c10::Half does
inline uint16_t to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mant = x & 0x7fffffu;
    int32_t exp = (int32_t)((x >> 23) & 0xffu);
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
    int32_t e = exp - 112;  // the fp16 biased exponent
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        int shift = 14 - e;
        uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13), rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rounds up into the exponent (or inf)
    return (uint16_t)h;
}

inline float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
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
        } while (!(mant & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

constexpr float HALF_TINY = 6.103515625e-05f;  // torch.finfo(torch.float16).tiny: the smallest grid scale

inline float at_least_tiny(float v) { return v < HALF_TINY ? HALF_TINY : v; }  // clamp_(min=tiny); NaN stays

// One grid of g values (already normalised): its codes into q (one byte per value), its scale / offset bits.
void encode_grid(const float* v, int g, int kind, int bits, float factor, float clip, const float* mids, int n_mids,
                 int32_t* q, uint16_t* scale_bits, uint16_t* offset_bits) {
    bool codebook = kind == KV_T4 || kind == KV_T8;
    bool symmetric = codebook || kind == KV_I8 || kind == KV_I4;
    if (symmetric) {
        float absmax = 0.0f;
        for (int i = 0; i < g; ++i) {
            float a = std::fabs(v[i]);
            if (a > absmax || std::isnan(a)) absmax = a;  // amax propagates NaN
        }
        float s = codebook ? at_least_tiny(absmax) : at_least_tiny(absmax * factor);
        *scale_bits = to_half(s);
        s = from_half(*scale_bits);
        if (codebook) {
            for (int i = 0; i < g; ++i) {
                float x = v[i] / s;
                int c = 0;
                while (c < n_mids && mids[c] < x) ++c;
                q[i] = c;
            }
        } else {
            float lo = -(float)(1 << (bits - 1)), hi = (float)((1 << (bits - 1)) - 1);
            for (int i = 0; i < g; ++i) {
                float r = std::nearbyint(v[i] / s);
                q[i] = (int32_t)(r < lo ? lo : r > hi ? hi : r);
            }
        }
        return;
    }
    float lo = v[0], hi = v[0];
    for (int i = 1; i < g; ++i) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    float mid = (hi + lo) / 2.0f, half = (hi - lo) / 2.0f * clip;
    float top = (float)((1 << bits) - 1);
    *scale_bits = to_half(at_least_tiny(2.0f * half / top));
    *offset_bits = to_half(mid - half);
    float s = from_half(*scale_bits), o = from_half(*offset_bits);
    for (int i = 0; i < g; ++i) {
        float r = std::nearbyint((v[i] - o) / s);
        q[i] = (int32_t)(r < 0.0f ? 0.0f : r > top ? top : r);
    }
}

}  // namespace

extern "C" {

// Quantize tokens x (token t, head h, channel i at x[t * tok_stride + h * head_stride_x + i], float32) into the
// stores kv (codes / scale / offset rows h * kv->head_stride + slots[t]). positions[t]: the token's cache
// position (the rotating key centre's row; may be null without one). factor[h]: clip / qmax of head h (the
// symmetric grids' scale factor), clip[h]: the clipping ratio (asymmetric grids), mids: the codebook's
// n_mids level midpoints (codebooks only). bits: 4 or 8.
void sq_kv_write(const float* x, int64_t tokens, int64_t tok_stride, int64_t head_stride_x, int32_t heads,
                 int32_t d, const int64_t* slots, const int64_t* positions, const sq_kv_view* kv,
                 const float* factor, const float* clip, const float* mids, int32_t n_mids, int32_t bits) {
    int groups = kv->groups, g = d / groups;
    bool packed = kv->kind == KV_I4 || kv->kind == KV_U4 || kv->kind == KV_T4;
    int width = packed ? d / 2 : d;
    float v[1024];
    int32_t q[1024];
    for (int64_t t = 0; t < tokens; ++t) {
        for (int32_t h = 0; h < heads; ++h) {
            const float* src = x + t * tok_stride + h * head_stride_x;
            if (kv->ch_scale != nullptr) {  // the key normaliser: (x - centre) / scale
                const float* centre = kv->center_rows ? kv->ch_center + ((int64_t)h * kv->center_rows + positions[t]) * d
                                                      : kv->ch_center + (int64_t)h * d;
                const float* scale = kv->ch_scale + (int64_t)h * d;
                for (int i = 0; i < d; ++i) v[i] = (src[i] - centre[i]) / scale[i];
            } else {
                for (int i = 0; i < d; ++i) v[i] = src[i];
            }
            int64_t row = (int64_t)h * kv->head_stride + slots[t];
            for (int grid = 0; grid < groups; ++grid) {
                uint16_t sb = 0, ob = 0;
                encode_grid(v + grid * g, g, kv->kind, bits, factor[h], clip[h], mids, n_mids, q + grid * g, &sb, &ob);
                kv->scale[row * groups + grid] = sb;
                if (kv->offset != nullptr) kv->offset[row * groups + grid] = ob;
            }
            uint8_t* out = (uint8_t*)kv->codes + row * width;
            if (packed) {
                for (int i = 0; i < d / 2; ++i)
                    out[i] = (uint8_t)((q[2 * i] & 0x0f) | ((q[2 * i + 1] & 0x0f) << 4));
            } else {
                for (int i = 0; i < d; ++i) out[i] = (uint8_t)(q[i] & 0xff);  // int8 codes: two's complement
            }
        }
    }
}

}  // extern "C"
