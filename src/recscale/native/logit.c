/*
 * The logit layer of a top MLP (n -> 1), forward and backward, each one pass over its
 * input (AVX2 + FMA):
 *
 *     forward    z[b]  = <h[b, :], w> + bias                          h [batch, n], row stride ldh
 *     backward   dw[i] = sum_b dz[b] h[b, i]       db = sum_b dz[b]
 *                dh[b, i] = dz[b] w[i]  (0 where h[b, i] <= 0 when `mask`: h is the
 *                           previous layer's ReLU output, whose gradient this is)
 *
 * Why: as torch ops this layer is a GEMV, a [B, 1] x [1, n] outer product, a GEMV for
 * dw, a sum and a ReLU mask - five passes, each waking the intra-op threads for a few
 * microseconds of work; in config A's step they took ~0.9 ms, several times what one
 * thread needs to stream h (2 MB) twice.
 */
#include <stdint.h>

#include "recscale_native.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_AVX2 __attribute__((target("avx2,fma")))

RS_AVX2 static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

RS_AVX2 void recscale_logit_forward(const float *h, int64_t ldh, const float *w, float bias,
                                    float *z, int64_t batch, int64_t n) {
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t b = 0; b < batch; ++b) {
        const float *hb = h + b * ldh;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(hb + i), _mm256_loadu_ps(w + i), acc);
        float s = hsum(acc);
        for (int64_t i = n8; i < n; ++i) s += hb[i] * w[i];
        z[b] = s + bias;
    }
}

/* dw [n] and *db are written (not accumulated); dh [batch, n] (row stride lddh) when not
 * NULL. */
RS_AVX2 void recscale_logit_backward(const float *h, int64_t ldh, const float *w, const float *dz,
                                     float *dw, float *db, float *dh, int64_t lddh, int64_t batch,
                                     int64_t n, int mask) {
    const int64_t n8 = n & ~(int64_t)7;
    const __m256 zero = _mm256_setzero_ps();
    float bsum = 0.0f;
    for (int64_t i = 0; i < n; ++i) dw[i] = 0.0f;
    for (int64_t b = 0; b < batch; ++b) {
        const float *hb = h + b * ldh;
        const float g = dz[b];
        const __m256 gv = _mm256_set1_ps(g);
        bsum += g;
        for (int64_t i = 0; i < n8; i += 8) {
            const __m256 hv = _mm256_loadu_ps(hb + i);
            _mm256_storeu_ps(dw + i, _mm256_fmadd_ps(gv, hv, _mm256_loadu_ps(dw + i)));
            if (dh) {
                __m256 d = _mm256_mul_ps(gv, _mm256_loadu_ps(w + i));
                if (mask) d = _mm256_and_ps(d, _mm256_cmp_ps(hv, zero, _CMP_GT_OQ));
                _mm256_storeu_ps(dh + b * lddh + i, d);
            }
        }
        for (int64_t i = n8; i < n; ++i) {
            dw[i] += g * hb[i];
            if (dh) dh[b * lddh + i] = (!mask || hb[i] > 0.0f) ? g * w[i] : 0.0f;
        }
    }
    *db = bsum;
}

#else /* not x86-64: the library does not load there (recscale_cpu_features) */
void recscale_logit_forward(const float *h, int64_t ldh, const float *w, float bias, float *z,
                            int64_t batch, int64_t n) {
    for (int64_t b = 0; b < batch; ++b) {
        float s = bias;
        for (int64_t i = 0; i < n; ++i) s += h[b * ldh + i] * w[i];
        z[b] = s;
    }
}
void recscale_logit_backward(const float *h, int64_t ldh, const float *w, const float *dz,
                             float *dw, float *db, float *dh, int64_t lddh, int64_t batch,
                             int64_t n, int mask) {
    float bsum = 0.0f;
    for (int64_t i = 0; i < n; ++i) dw[i] = 0.0f;
    for (int64_t b = 0; b < batch; ++b) {
        bsum += dz[b];
        for (int64_t i = 0; i < n; ++i) {
            const float hv = h[b * ldh + i];
            dw[i] += dz[b] * hv;
            if (dh) dh[b * lddh + i] = (!mask || hv > 0.0f) ? dz[b] * w[i] : 0.0f;
        }
    }
    *db = bsum;
}
#endif
