/*
 * Stored row formats of the embedding kernels: 8 values at a time to and from fp32.
 *
 *     RS_F32   float                      (plain tables)
 *     RS_F16   IEEE half      (F16C)      (embedding.row_precision = fp16)
 *     RS_BF16  bfloat16 = the top 16 bits of a float
 *
 * Stores to a 16-bit format round stochastically: of the two neighbours lo (x rounded
 * toward zero) and hi (one step further from zero) it takes hi when
 *
 *     noise < (|x| - |lo|) / (|hi| - |lo|),     noise = n16 / 2^16,
 *
 * an unbiased choice up to 2^-17 of a grid step (E[stored] = x). For bf16 that is the
 * integer test n16 < (the 16 bits truncation drops); for fp16 it is computed as
 * n16 * (ulp * 2^-16) < |x| - |lo| - every product exact (ulp >= 2^-24), no division.
 * The torch reference (embedding/low_precision.py: round_to_grid) states the same rule,
 * so the two agree bit for bit. n16 is a 16-bit hash of (step, row, column) so a
 * resumed run rounds as the uninterrupted one did: rs_row_hash once a row, then one
 * 32-bit rs_hash8 lane per two columns (columns c + i and c + 8 + i of each block of
 * 16 take its low and its high half).
 */
#ifndef RECSCALE_ROW_FORMAT_H
#define RECSCALE_ROW_FORMAT_H

#include <stdint.h>

#define RS_F32 0
#define RS_F16 1
#define RS_BF16 2
#define RS_SPLIT 3 /* Split-SGD-BF16: bf16 high halves here, the low 16 bits apart (exact) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_ROW_INLINE __attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline))

/* Bytes of one stored value. */
static inline int64_t rs_value_bytes(int wt) { return wt == RS_F32 ? 4 : 2; }

/* Values [i, i + 8) of a row block at base, as fp32. */
RS_ROW_INLINE __m256 rs_load8(const void *base, int64_t i, const int wt) {
    if (wt == RS_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (wt == RS_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 fp32 -> 8 bf16 rounded to nearest even, as torch casts a finite value (a NaN becomes
 * 0x7FC0, as there): bf16_bits.h's rs_bf16_round16 in AVX2, for kernels of this target. */
RS_ROW_INLINE __m128i rs_bf16_nearest8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    /* 32 -> 16 bits: packus within each 128-bit lane, then lanes' low halves together */
    const __m256i p = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

/* splitmix64's finalizer over (row, step): 32 bits a row. */
static inline uint32_t rs_row_hash(uint64_t step, uint64_t row) {
    uint64_t z = row * 0x9E3779B97F4A7C15ull + step * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)z;
}

/* fmix32 (murmur3) of rh + (8 * block + lane) * 0x9E3779B9 (mod 2^32), 8 lanes: the
 * noise of columns 16 * block + lane (low half) and 16 * block + 8 + lane (high half). */
RS_ROW_INLINE __m256i rs_hash8(uint32_t rh, int64_t block) {
#define RS_G(k) ((int32_t)(0x9E3779B9u * (k)))
    const __m256i lanes = _mm256_setr_epi32(RS_G(0u), RS_G(1u), RS_G(2u), RS_G(3u), RS_G(4u),
                                            RS_G(5u), RS_G(6u), RS_G(7u));
#undef RS_G
    __m256i v = _mm256_add_epi32(
        _mm256_set1_epi32((int32_t)(rh + 0x9E3779B9u * 8u * (uint32_t)block)), lanes);
    v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
    v = _mm256_mullo_epi32(v, _mm256_set1_epi32((int32_t)0x85EBCA6Bu));
    v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 13));
    v = _mm256_mullo_epi32(v, _mm256_set1_epi32((int32_t)0xC2B2AE35u));
    return _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
}

/* Store fp32 x as values [i, i + 8) of a 16-bit row block at base, rounded
 * stochastically with noise n16 (8 lanes of 16 bits in 32). */
RS_ROW_INLINE void rs_store8(void *base, int64_t i, __m256 x, __m256i n16, const int wt) {
    __m256i up; /* all ones where the magnitude goes one step up */
    __m256i lo; /* the 16-bit patterns toward zero, one per 32-bit lane */
    if (wt == RS_F16) {
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const __m128i lo16 = _mm256_cvtps_ph(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 alo = _mm256_and_ps(_mm256_cvtph_ps(lo16), abs_mask);
        const __m256 ahi = _mm256_and_ps(_mm256_cvtph_ps(_mm_add_epi16(lo16, _mm_set1_epi16(1))),
                                         abs_mask);
        const __m256 scaled = _mm256_mul_ps(
            _mm256_cvtepi32_ps(n16), _mm256_mul_ps(_mm256_sub_ps(ahi, alo), _mm256_set1_ps(0x1p-16f)));
        up = _mm256_castps_si256(
            _mm256_cmp_ps(scaled, _mm256_sub_ps(_mm256_and_ps(x, abs_mask), alo), _CMP_LT_OQ));
        lo = _mm256_cvtepu16_epi32(lo16);
    } else {
        const __m256i bits = _mm256_castps_si256(x);
        up = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF)), n16);
        lo = _mm256_srli_epi32(bits, 16);
    }
    const __m256i v = _mm256_sub_epi32(lo, up); /* + 1 where up (up = -1 there) */
    const __m128i out = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)base + i), out);
}

/* Store the fp32 row x[0 .. d) at base in a 16-bit format, with the noise of row hash rh. */
RS_ROW_INLINE void rs_store_row(void *base, const float *x, const int64_t d, uint32_t rh,
                                const int wt) {
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    for (int64_t c = 0; c < d; c += 16) {
        const __m256i h = rs_hash8(rh, c / 16);
        rs_store8(base, c, _mm256_loadu_ps(x + c), _mm256_and_si256(h, low), wt);
        if (c + 8 < d) rs_store8(base, c + 8, _mm256_loadu_ps(x + c + 8), _mm256_srli_epi32(h, 16), wt);
    }
}
#endif
#endif
