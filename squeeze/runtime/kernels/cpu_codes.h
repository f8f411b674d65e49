// Code-unpacking helpers shared by the native kernels (cpu_lut.cpp: float32 LUT kernels; cpu_w8.cpp: W4A8).
//
// Each helper is compiled for its own instruction set (the push_options / target pragmas below) and is
// inlined into the kernels of that set or a wider one: a file brings one into its avx2 / avx512 namespace
// with a using-declaration (`using sq_codes::avx2::words3;`). Header-only, no state.

#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace sq_codes {

#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {

// 8 groups of three bytes (24 bytes at p) -> 8 dwords, group g in the low 24 bits of dword g; reads only p[0..23]
__attribute__((always_inline)) inline __m256i words3(const uint8_t* p) {
    const __m256i shuf = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
                                          4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1);
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(p + 8)), _mm_loadu_si128((const __m128i*)p));
    return _mm256_shuffle_epi8(v, shuf);
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi")
namespace avx512 {

// 16 groups of three bytes (48 bytes at p) -> 16 dwords; reads exactly p[0..47] with two plain loads (a masked
// 48-byte load made the 3-bit path slower than AVX2's when the codes stream from memory)
__attribute__((always_inline)) inline __m512i words3(const uint8_t* p) {
    alignas(64) static const uint8_t idx[64] = {
        0,  1,  2,  0, 3,  4,  5,  0, 6,  7,  8,  0, 9,  10, 11, 0, 12, 13, 14, 0, 15, 16, 17, 0,
        18, 19, 20, 0, 21, 22, 23, 0, 24, 25, 26, 0, 27, 28, 29, 0, 30, 31, 32, 0, 33, 34, 35, 0,
        36, 37, 38, 0, 39, 40, 41, 0, 42, 43, 44, 0, 45, 46, 47, 0};
    const __m512i data = _mm512_inserti32x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                                            _mm_loadu_si128((const __m128i*)(p + 32)), 2);
    return _mm512_maskz_permutexvar_epi8(0x7777777777777777ull, _mm512_load_si512(idx), data);
}

}  // namespace avx512
#pragma GCC pop_options

}  // namespace sq_codes
