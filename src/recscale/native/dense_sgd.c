/*
 * The dense SGD step (no momentum) over a list of fp32 tensors, writing the bf16 copies
 * the next forward's GEMMs read in the same pass (AVX-512 F/BW/VL, or AVX2 + FMA):
 *
 *   d      = g[i] + wd w[i]        (wd != 0; one fused multiply-add)
 *   w[i]  <- w[i] + (-lr) d        (one fused multiply-add)
 *   wb[i] <- bf16(w[i])            rounded to nearest even, a NaN as 0x7FC0 (wb NULL: none)
 *
 * Bit for bit what torch.optim.SGD's two adds (`grads + wd params`, then `params + (-lr)
 * grads`: ATen's vectorized add with alpha is a fused multiply-add) and `w.to(bfloat16)`
 * give. Why one pass: in config A's bf16 step the optimizer's pass over the weights and
 * the forward's casts of them to bf16 are two passes and 2 x 15 framework ops; here the
 * copy is written from the register the update leaves, and the cast is gone. Without
 * copies (an fp32 step) it is still one call for the 15 ops.
 *
 * Work: tensor t is cut into blocks of `block` elements; blocks are numbered through the
 * list in order, and a call does blocks [lo, hi) (threads take disjoint ranges: every
 * element is computed alone, so any split gives the same bits). Tensor pointers come as
 * addresses in int64 arrays (w, g, wb: 0 for no copy).
 */
#include <stdint.h>

#include "bf16_bits.h"
#include "recscale_native.h"
#include "row_format.h"

int recscale_sgd_wide = 1; /* 0: the AVX2 pass on an AVX-512 CPU too (tests) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

RS_BF16_BITS static void sgd_span(float *w, const float *g, uint16_t *wb, int64_t n, float lr,
                                  float wd) {
    const __m512 neg_lr = _mm512_set1_ps(-lr), decay = _mm512_set1_ps(wd);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = rs_lanes16(n - i);
        const __m512 x = _mm512_maskz_loadu_ps(m, w + i);
        __m512 d = _mm512_maskz_loadu_ps(m, g + i);
        if (wd != 0.0f) d = _mm512_fmadd_ps(x, decay, d);
        const __m512 y = _mm512_fmadd_ps(d, neg_lr, x);
        _mm512_mask_storeu_ps(w + i, m, y);
        if (wb) _mm256_mask_storeu_epi16(wb + i, m, rs_bf16_round16(y));
    }
}

/* the library's floor (AVX2 + FMA + F16C): row_format.h's rounding inlines here */
#define RS_AVX2 __attribute__((target("avx2,fma,f16c")))

RS_AVX2 static void sgd_span_avx2(float *w, const float *g, uint16_t *wb, int64_t n, float lr,
                                  float wd) {
    const __m256 neg_lr = _mm256_set1_ps(-lr), decay = _mm256_set1_ps(wd);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(w + i);
        __m256 d = _mm256_loadu_ps(g + i);
        if (wd != 0.0f) d = _mm256_fmadd_ps(x, decay, d);
        const __m256 y = _mm256_fmadd_ps(d, neg_lr, x);
        _mm256_storeu_ps(w + i, y);
        if (wb) _mm_storeu_si128((__m128i *)(wb + i), rs_bf16_nearest8(y));
    }
    if (i < n) { /* the tail through a copy of 8 (the same operations, lane for lane) */
        float x8[8] = {0}, g8[8] = {0};
        uint16_t b8[8];
        for (int64_t j = i; j < n; j++) x8[j - i] = w[j], g8[j - i] = g[j];
        sgd_span_avx2(x8, g8, wb ? b8 : 0, 8, lr, wd);
        for (int64_t j = i; j < n; j++) {
            w[j] = x8[j - i];
            if (wb) wb[j] = b8[j - i];
        }
    }
}

int recscale_sgd_bf16(int64_t tensors, const int64_t *w, const int64_t *g, const int64_t *wb,
                      const int64_t *numel, int64_t block, float lr, float wd, int64_t lo,
                      int64_t hi) {
    const int cpu = recscale_cpu_features();
    if (!(cpu & (RS_CPU_AVX512F | RS_CPU_AVX2)) || block <= 0) return -1;
    void (*span)(float *, const float *, uint16_t *, int64_t, float, float) =
        cpu & RS_CPU_AVX512F && recscale_sgd_wide ? sgd_span : sgd_span_avx2;
    int64_t first = 0; /* the number of tensor t's first block */
    for (int64_t t = 0; t < tensors && first < hi; t++) {
        const int64_t blocks = (numel[t] + block - 1) / block;
        const int64_t b0 = lo > first ? lo - first : 0;
        const int64_t b1 = hi - first < blocks ? hi - first : blocks;
        if (b0 < b1) {
            const int64_t e0 = b0 * block, e1 = b1 * block < numel[t] ? b1 * block : numel[t];
            uint16_t *copy = wb[t] ? (uint16_t *)(intptr_t)wb[t] + e0 : 0;
            span((float *)(intptr_t)w[t] + e0, (const float *)(intptr_t)g[t] + e0, copy,
                     e1 - e0, lr, wd);
        }
        first += blocks;
    }
    return 0;
}

#else

int recscale_sgd_bf16(int64_t tensors, const int64_t *w, const int64_t *g, const int64_t *wb,
                      const int64_t *numel, int64_t block, float lr, float wd, int64_t lo,
                      int64_t hi) {
    (void)tensors, (void)w, (void)g, (void)wb, (void)numel, (void)block, (void)lr, (void)wd;
    (void)lo, (void)hi;
    return -1;
}

#endif
