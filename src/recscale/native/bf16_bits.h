/*
 * The bf16 <-> fp32 conversions the bf16 kernels share (input_grad_amx.c,
 * small_layers_bf16.c, dot_interaction_bf16.c, dot_interaction_avx512.c), in AVX-512 F
 * (the two conversions) and F/BW/VL (callers compiled for a wider target inline them):
 *
 *   rs_bf16_round16   16 fp32 -> 16 bf16, rounded to nearest even as torch rounds a
 *                     finite value; a NaN stays a NaN (0x7FC0)
 *   rs_bf16_widen16   16 bf16 -> 16 fp32, exact
 *   rs_bf16_kept16    which of 16 bf16 a ReLU's gradient keeps, as threshold_backward:
 *                     all but x <= 0 (x > 0 as int16, or a NaN: magnitude past +inf's)
 *   rs_lanes16        the mask of the first min(left, 16) of 16 lanes (none for left <= 0)
 *   rs_bf16_round_n   n fp32 -> n bf16 with rs_bf16_round16
 *   rs_bf16_ready     whether the CPU runs the bf16 kernels (AVX512-BF16)
 */
#ifndef RECSCALE_BF16_BITS_H
#define RECSCALE_BF16_BITS_H

#include "recscale_native.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_BF16_BITS __attribute__((target("avx512f,avx512bw,avx512vl")))
#define RS_BF16_F __attribute__((target("avx512f")))

RS_BF16_F static inline __m256i rs_bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

RS_BF16_F static inline __m512 rs_bf16_widen16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

RS_BF16_BITS static inline __mmask16 rs_bf16_kept16(__m256i x) {
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7FFF));
    return _mm256_cmpgt_epi16_mask(x, _mm256_setzero_si256()) |
           _mm256_cmpgt_epi16_mask(mag, _mm256_set1_epi16(0x7F80));
}

static inline __mmask16 rs_lanes16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

RS_BF16_BITS static inline void rs_bf16_round_n(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = rs_lanes16(n - i);
        _mm256_mask_storeu_epi16(dst + i, m, rs_bf16_round16(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

static inline int rs_bf16_ready(void) {
    return (recscale_cpu_features() & RS_CPU_AVX512_BF16) != 0;
}

#endif
#endif
