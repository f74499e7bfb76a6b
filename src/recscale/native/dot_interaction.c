/*
 * Fused DLRM dot interaction, forward and backward, for x86-64 CPUs with AVX2 + FMA.
 *
 * Built by `pip install` as the optional extension recscale.native._kernels and called
 * through ctypes (recscale/native/__init__.py); the functions take raw fp32 pointers and
 * a sample range [b0, b1), so Python threads can split a batch (ctypes drops the GIL).
 *
 * Per sample b, T is the [k, d] matrix of the vectors that interact:
 *
 *     T[0]       = dense[b, :]                       (only when has_dense)
 *     T[e0 + f]  = emb[b * esb + f * esf + 0 .. d)   f = 0 .. k - e0 - 1
 *
 * Forward writes one row of `out` (row stride `width`):
 *
 *     out[b] = [ dense[b] (d, when has_dense) | <T_i, T_j> for i < j (i <= j with
 *                self_interaction), in triu_indices order | zeros up to width ]
 *
 * Backward: with g the incoming gradient row and G the symmetric k x k matrix of the
 * pair gradients (G_ij = G_ji = g_p; G_ii = 2 g_p for a self pair, else 0),
 *
 *     grad_T = G @ T    and    grad_dense[b] = grad_T[0] + g[0 .. d)   (the pass-through)
 *
 * grad_emb rows are written with strides (gsb, gsf) like emb. d must be a multiple of 8
 * (one 256-bit vector = 8 floats); callers check and fall back to the numba kernels.
 *
 * Why not auto-vectorized C or numba: with d = 16 every loop is too short for the loop
 * vectorizer (it wants 32 iterations) and the reductions come out scalar: 4.2 ms forward
 * and 10.6 ms backward for a 2048 x 27 x 16 batch on one core, against 0.7 and 1.4 ms here.
 */
#include <stdint.h>

#include "recscale_native.h"
#include <stdlib.h>
#include <string.h>

#define RS_AHEAD 4 /* samples */


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_HAVE_X86 1
#define RS_AVX2 __attribute__((target("avx2,fma")))

/* Lane u of the result = horizontal sum of v[u]. */
RS_AVX2 static inline __m256 hsum8(const __m256 *v) {
    __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    /* a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves), b for 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Copy sample b's T into t ([k + 8, d], rows past k zero: a block of 8 pairs may read them). */
static inline __attribute__((always_inline)) void load_t(float *t, const float *dense,
                                                          const float *emb, int64_t b, int64_t k,
                                                          const int64_t d, int64_t e0, int64_t dsb,
                                                          int64_t esb, int64_t esf) {
    if (e0) memcpy(t, dense + b * dsb, (size_t)d * sizeof(float));
    /* A feature-major layout puts a sample's rows B*d floats apart: too many streams for
     * the hardware prefetcher, so fetch the rows of the sample a few ahead by hand. */
    if (esf != d)
        for (int64_t f = 0; f < k - e0; ++f)
            __builtin_prefetch(emb + (b + RS_AHEAD) * esb + f * esf, 0, 3);
    if (esf == d) { /* the features of a sample are contiguous: one copy */
        memcpy(t + e0 * d, emb + b * esb, (size_t)((k - e0) * d) * sizeof(float));
        return;
    }
    for (int64_t f = 0; f < k - e0; ++f)
        memcpy(t + (e0 + f) * d, emb + b * esb + f * esf, (size_t)d * sizeof(float));
}

#define RS_INLINE RS_AVX2 static inline __attribute__((always_inline))

/* The first min(n, 8) lanes of s to o[p ..]; returns the next column. */
RS_INLINE int64_t store_pairs(float *restrict o, int64_t p, __m256 s, int64_t n) {
    if (n >= 8) {
        _mm256_storeu_ps(o + p, s);
        return p + 8;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, s);
    for (int64_t u = 0; u < n; ++u) o[p++] = tmp[u];
    return p;
}

/* The pairs (i, j >= i + offset) of one sample into o[first ..]; returns the next column. */
RS_INLINE int64_t pairs(const float *restrict t, float *restrict o, int64_t first, int64_t k, const int64_t d,
                        int64_t offset) {
    int64_t p = first;
    for (int64_t i = 0; i < k; ++i) {
        const float *ti = t + i * d;
        if (d <= 32) { /* row i in registers (d is a constant here) */
            __m256 a[4];
            for (int64_t c = 0; c < d; c += 8) a[c / 8] = _mm256_loadu_ps(ti + c);
            for (int64_t j = i + offset; j < k; j += 8) {
                __m256 v[8];
                for (int u = 0; u < 8; ++u) {
                    const float *tj = t + (j + u) * d;
                    __m256 acc = _mm256_mul_ps(a[0], _mm256_loadu_ps(tj));
                    for (int64_t c = 8; c < d; c += 8)
                        acc = _mm256_fmadd_ps(a[c / 8], _mm256_loadu_ps(tj + c), acc);
                    v[u] = acc;
                }
                p = store_pairs(o, p, hsum8(v), k - j);
            }
            continue;
        }
        for (int64_t j = i + offset; j < k; j += 8) {
            __m256 v[8];
            for (int u = 0; u < 8; ++u) {
                const float *tj = t + (j + u) * d;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(ti), _mm256_loadu_ps(tj));
                for (int64_t c = 8; c < d; c += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(ti + c), _mm256_loadu_ps(tj + c), acc);
                v[u] = acc;
            }
            p = store_pairs(o, p, hsum8(v), k - j);
        }
    }
    return p;
}

RS_INLINE void forward_impl(const float *dense, const float *emb, float *out, int64_t b0,
                            int64_t b1, int64_t k, const int64_t d, int64_t e0, int64_t offset,
                            int64_t width, int64_t dsb, int64_t esb, int64_t esf, float *t) {
    memset(t + k * d, 0, (size_t)(8 * d) * sizeof(float));
    for (int64_t b = b0; b < b1; ++b) {
        float *o = out + b * width;
        load_t(t, dense, emb, b, k, d, e0, dsb, esb, esf);
        if (e0) memcpy(o, t, (size_t)d * sizeof(float));
        int64_t p = pairs(t, o, e0 * d, k, d, offset);
        for (; p < width; ++p) o[p] = 0.0f;
    }
}

/* The scratch of the tiled forwards (here and in dot_interaction_avx512.c): a zero row of
 * d floats (the rows past k), k + 4 row pointers and k + 1 pair columns. 0, or -2
 * without memory (none kept); recscale_tile_scratch_free releases it. */
__attribute__((visibility("hidden"))) int recscale_tile_scratch(int64_t k, int64_t d, float **zero,
                                                                const float ***rows,
                                                                int64_t **start) {
    *zero = aligned_alloc(64, (size_t)((d + 15) & ~(int64_t)15) * sizeof(float));
    *rows = malloc((size_t)(k + 4) * sizeof(float *));
    *start = malloc((size_t)(k + 1) * sizeof(int64_t));
    if (*zero && *rows && *start) {
        memset(*zero, 0, (size_t)d * sizeof(float));
        return 0;
    }
    recscale_tile_scratch_free(*zero, *rows, *start);
    return -2;
}

__attribute__((visibility("hidden"))) void recscale_tile_scratch_free(float *zero,
                                                                      const float **rows,
                                                                      int64_t *start) {
    free(zero);
    free((void *)rows);
    free(start);
}

/* Wide vectors (d >= 64, a multiple of 8) without AVX-512: the pairs in 2 x 4 tiles of
 * rows (I, J), 8 accumulators - per 8 floats of d, 6 loads feed 8 FMAs, where the pair
 * kernel above loads both vectors for every FMA (d = 128 spills its rows: B's forward
 * 4.0 ms on 2 threads). One hsum8 reduces a tile; only its pairs with j >= i + offset
 * and j < k are stored. Rows are read in place (rows past k: a zero row), and the next
 * sample's embedding rows are prefetched over the current sample's tiles. */
RS_INLINE __m256 tile2x4(const float *const *ri, const float *const *rj, const int64_t d) {
    __m256 acc[8];
    for (int n = 0; n < 8; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 a0 = _mm256_loadu_ps(ri[0] + c), a1 = _mm256_loadu_ps(ri[1] + c);
        for (int v = 0; v < 4; ++v) {
            const __m256 b = _mm256_loadu_ps(rj[v] + c);
            acc[v] = _mm256_fmadd_ps(a0, b, acc[v]);
            acc[4 + v] = _mm256_fmadd_ps(a1, b, acc[4 + v]);
        }
    }
    return hsum8(acc); /* lane 4 u + v: <ri[u], rj[v]> */
}

RS_INLINE void forward_tiles(const float *dense, const float *emb, float *out, int64_t b0,
                             int64_t b1, int64_t k, const int64_t d, int64_t e0, int64_t offset,
                             int64_t width, int64_t dsb, int64_t esb, int64_t esf,
                             const float *zero, const float **rows, int64_t *start) {
    const int64_t kp = (k + 3) & ~(int64_t)3, first = e0 * d;
    for (int64_t i = 0, p = first; i < k; ++i) { /* start[i]: the column of (i, i + offset) */
        start[i] = p;
        p += k - i - offset;
    }
    const int64_t npairs = k * (k - 2 * offset + 1) / 2, lines = (k - e0) * (d / 16);
    int64_t ntiles = 0;
    for (int64_t I = 0; 2 * I < k; ++I) ntiles += kp / 4 - I / 2; /* as the loop below */
    for (int64_t b = b0; b < b1; ++b) {
        float *o = out + b * width;
        if (e0) rows[0] = dense + b * dsb;
        for (int64_t f = 0; f < k - e0; ++f) rows[e0 + f] = emb + b * esb + f * esf;
        for (int64_t r = k; r < kp; ++r) rows[r] = zero;
        if (e0) memcpy(o, rows[0], (size_t)d * sizeof(float));
        int64_t t = 0;
        for (int64_t I = 0; 2 * I < k; ++I)
            for (int64_t J = I / 2; J < kp / 4; ++J, ++t) {
                if (b + 1 < b1) { /* this tile's share of the next sample's rows */
                    const float *e = emb + (b + 1) * esb;
                    for (int64_t l = lines * t / ntiles; l < lines * (t + 1) / ntiles; ++l)
                        _mm_prefetch((const char *)(e + (l / (d / 16)) * esf + 16 * (l % (d / 16))),
                                     _MM_HINT_T0);
                }
                float s[8];
                _mm256_storeu_ps(s, tile2x4(rows + 2 * I, rows + 4 * J, d));
                for (int64_t u = 0; u < 2 && 2 * I + u < k; ++u) {
                    const int64_t i = 2 * I + u;
                    for (int64_t v = 0; v < 4; ++v) {
                        const int64_t j = 4 * J + v;
                        if (j >= i + offset && j < k) o[start[i] + j - i - offset] = s[4 * u + v];
                    }
                }
            }
        for (int64_t p = first + npairs; p < width; ++p) o[p] = 0.0f;
    }
}

RS_AVX2 static int forward_tiles_range(const float *dense, const float *emb, float *out,
                                       int64_t b0, int64_t b1, int64_t k, int64_t d, int64_t e0,
                                       int64_t offset, int64_t width, int64_t dsb, int64_t esb,
                                       int64_t esf) {
    float *zero;
    const float **rows;
    int64_t *start;
    if (recscale_tile_scratch(k, d, &zero, &rows, &start)) return -2;
    if (d == 128)
        forward_tiles(dense, emb, out, b0, b1, k, 128, e0, offset, width, dsb, esb, esf, zero, rows, start);
    else if (d == 64)
        forward_tiles(dense, emb, out, b0, b1, k, 64, e0, offset, width, dsb, esb, esf, zero, rows, start);
    else
        forward_tiles(dense, emb, out, b0, b1, k, d, e0, offset, width, dsb, esb, esf, zero, rows, start);
    recscale_tile_scratch_free(zero, rows, start);
    return 0;
}

/* Rows [i, i + N) (N = 4 or 1, a constant so the accumulators stay in registers) of
 * grad_T = G @ T, columns [c, c + 8 W) with W = 1 or 2 vectors per row: up to 8
 * independent FMA chains, each T row load shared by N rows. G holds only its upper
 * triangle and diagonal (row-major, k x k): the coefficient of (r, j) is G[r][j] for
 * j >= r and G[j][r] below, so the j loop runs in three ranges with fixed addressing.
 * The rows are stored to grad_dense (row 0 with dense features, plus the pass-through
 * gradient) or grad_emb. */
RS_INLINE void grad_rows(const float *restrict G, const float *restrict t,
                         const float *restrict gb, float *restrict gd_b, float *restrict ge_b,
                         int64_t k, int64_t d, int64_t e0, int64_t gsf, int64_t i, const int N,
                         int64_t c, const int W) {
    __m256 acc[4][2];
    for (int u = 0; u < N; ++u)
        for (int w = 0; w < W; ++w) acc[u][w] = _mm256_setzero_ps();
#define RS_ROW_J(ADDR)                                                                  \
    {                                                                                   \
        __m256 tj[2];                                                                   \
        for (int w = 0; w < W; ++w) tj[w] = _mm256_loadu_ps(t + j * d + c + 8 * w);    \
        for (int u = 0; u < N; ++u) {                                                   \
            const __m256 gv = _mm256_broadcast_ss(G + (ADDR));                          \
            for (int w = 0; w < W; ++w) acc[u][w] = _mm256_fmadd_ps(gv, tj[w], acc[u][w]); \
        }                                                                               \
    }
    int64_t j = 0;
    for (; j < i; ++j) RS_ROW_J(j * k + i + u)          /* below the diagonal: G[j][r] */
    for (; j < i + N; ++j) RS_ROW_J(i + u <= j ? (i + u) * k + j : j * k + i + u)
    for (; j < k; ++j) RS_ROW_J((i + u) * k + j)        /* above: G[r][j] */
#undef RS_ROW_J
    for (int u = 0; u < N; ++u) {
        const int64_t r = i + u;
        for (int w = 0; w < W; ++w) {
            const int64_t cc = c + 8 * w;
            if (r < e0)
                _mm256_storeu_ps(gd_b + cc, _mm256_add_ps(acc[u][w], _mm256_loadu_ps(gb + cc)));
            else
                _mm256_storeu_ps(ge_b + (r - e0) * gsf + cc, acc[u][w]);
        }
    }
}

RS_INLINE void backward_impl(const float *dense, const float *emb, const float *g,
                             float *grad_dense, float *grad_emb, int64_t b0, int64_t b1, int64_t k,
                             const int64_t d, int64_t e0, int64_t offset, int64_t width,
                             int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                             float *t, float *G) {
    const int64_t first = e0 * d;
    for (int64_t b = b0; b < b1; ++b) {
        const float *gb = g + b * width;
        load_t(t, dense, emb, b, k, d, e0, dsb, esb, esf);
        /* Upper triangle and diagonal of G only: row i's pairs are contiguous in g. */
        int64_t p = first;
        for (int64_t i = 0; i < k; ++i) {
            const int64_t n = k - i - offset;
            float *row = G + i * k + i;
            if (offset) row[0] = 0.0f;
            int64_t q = 0;
            for (; q + 8 <= n; q += 8)
                _mm256_storeu_ps(row + offset + q, _mm256_loadu_ps(gb + p + q));
            for (; q < n; ++q) row[offset + q] = gb[p + q];
            p += n;
            if (!offset) row[0] *= 2.0f; /* d<T_i, T_i>/dT_i = 2 T_i (self_interaction) */
        }
        float *gd_b = grad_dense + b * d, *ge_b = grad_emb + b * gsb;
        if (d % 16 == 0) {
            for (int64_t c = 0; c < d; c += 16) {
                int64_t i = 0;
                for (; i + 4 <= k; i += 4) grad_rows(G, t, gb, gd_b, ge_b, k, d, e0, gsf, i, 4, c, 2);
                for (; i < k; ++i) grad_rows(G, t, gb, gd_b, ge_b, k, d, e0, gsf, i, 1, c, 2);
            }
        } else {
            for (int64_t c = 0; c < d; c += 8) {
                int64_t i = 0;
                for (; i + 4 <= k; i += 4) grad_rows(G, t, gb, gd_b, ge_b, k, d, e0, gsf, i, 4, c, 1);
                for (; i < k; ++i) grad_rows(G, t, gb, gd_b, ge_b, k, d, e0, gsf, i, 1, c, 1);
            }
        }
    }
}

/* One compiled copy per common dim (constant d: the loops over d unroll and T rows stay
 * in registers), and a generic one. */
#define RS_BY_DIM(d, CALL) \
    switch (d) {           \
    case 8: CALL(8); break;     \
    case 16: CALL(16); break;   \
    case 32: CALL(32); break;   \
    case 64: CALL(64); break;   \
    case 128: CALL(128); break; \
    default: CALL(d); break;    \
    }

RS_AVX2 static void forward_range(const float *dense, const float *emb, float *out, int64_t b0,
                                  int64_t b1, int64_t k, int64_t d, int64_t e0, int64_t offset,
                                  int64_t width, int64_t dsb, int64_t esb, int64_t esf, float *t) {
#define RS_FWD(D) forward_impl(dense, emb, out, b0, b1, k, D, e0, offset, width, dsb, esb, esf, t)
    RS_BY_DIM(d, RS_FWD)
#undef RS_FWD
}

RS_AVX2 static void backward_range(const float *dense, const float *emb, const float *g,
                                   float *grad_dense, float *grad_emb, int64_t b0, int64_t b1,
                                   int64_t k, int64_t d, int64_t e0, int64_t offset, int64_t width,
                                   int64_t dsb, int64_t esb, int64_t esf, int64_t gsb,
                                   int64_t gsf, float *t, float *G) {
#define RS_BWD(D)                                                                          \
    backward_impl(dense, emb, g, grad_dense, grad_emb, b0, b1, k, D, e0, offset, width, dsb, \
                  esb, esf, gsb, gsf, t, G)
    RS_BY_DIM(d, RS_BWD)
#undef RS_BWD
}
#endif

/* 1: d = 16 or 32 with k <= 32 runs dot_interaction_narrow.c where the CPU has AVX-512;
 * d >= 64 (a multiple of 16) runs the AVX-512 tiles of dot_interaction_avx512.c where
 * the CPU has AVX-512 (config B's d = 128: forward 3.2 -> 1.8 ms, backward 4.8-6.6 ->
 * 3.4-4.8 ms on 2 threads; B's step 167.9 -> 163.9 ms), else the forward in the AVX2
 * tiles above (d >= 64, a multiple of 8). 2: the AVX2 tiles even with AVX-512. 0: the
 * pair kernels. Tests set each, to hold every kernel to the reference. */
int recscale_dot_wide = 1;

/* Returns 0 on success, -1 when unsupported here (no AVX2 build, or d % 8 != 0), -2 when
 * out of memory. */
int recscale_dot_forward(const float *dense, const float *emb, float *out, int64_t b0, int64_t b1,
                         int64_t k, int64_t d, int64_t has_dense, int64_t self_interaction,
                         int64_t width, int64_t dense_stride, int64_t emb_sample_stride,
                         int64_t emb_feature_stride) {
#ifdef RS_HAVE_X86
    if (d % 8 != 0 || d <= 0) return -1;
    if (recscale_dot_wide == 1) { /* AVX-512: d = 16, 32 Gram rows; d >= 64 4 x 4 tiles */
        const int rc = recscale_dot_forward_avx512(
            dense, emb, out, b0, b1, k, d, has_dense ? 1 : 0, self_interaction ? 0 : 1, width,
            dense_stride, emb_sample_stride, emb_feature_stride, 0);
        if (rc != -1) return rc;
    }
    if (recscale_dot_wide && d >= 64) /* without AVX-512 (or asked for): 2 x 4 AVX2 tiles */
        return forward_tiles_range(dense, emb, out, b0, b1, k, d, has_dense ? 1 : 0,
                                   self_interaction ? 0 : 1, width, dense_stride,
                                   emb_sample_stride, emb_feature_stride);
    float *t = (float *)malloc((size_t)((k + 8) * d) * sizeof(float));
    if (!t) return -2;
    forward_range(dense, emb, out, b0, b1, k, d, has_dense ? 1 : 0, self_interaction ? 0 : 1,
                  width, dense_stride, emb_sample_stride, emb_feature_stride, t);
    free(t);
    return 0;
#else
    (void)dense, (void)emb, (void)out, (void)b0, (void)b1, (void)k, (void)d, (void)has_dense;
    (void)self_interaction, (void)width, (void)dense_stride, (void)emb_sample_stride;
    (void)emb_feature_stride;
    return -1;
#endif
}

int recscale_dot_backward(const float *dense, const float *emb, const float *grad_out,
                          float *grad_dense, float *grad_emb, int64_t b0, int64_t b1, int64_t k,
                          int64_t d, int64_t has_dense, int64_t self_interaction, int64_t width,
                          int64_t dense_stride, int64_t emb_sample_stride,
                          int64_t emb_feature_stride, int64_t grad_sample_stride,
                          int64_t grad_feature_stride) {
#ifdef RS_HAVE_X86
    if (d % 8 != 0 || d <= 0) return -1;
    if (recscale_dot_wide == 1) { /* AVX-512: d = 16, 32 by rows; d >= 64 in blocks */
        const int rc = recscale_dot_backward_avx512(
            dense, emb, grad_out, grad_dense, grad_emb, b0, b1, k, d, has_dense ? 1 : 0,
            self_interaction ? 0 : 1, width, dense_stride, emb_sample_stride,
            emb_feature_stride, grad_sample_stride, grad_feature_stride, 0);
        if (rc != -1) return rc;
    }
    float *t = (float *)malloc((size_t)(k * d + k * k) * sizeof(float));
    if (!t) return -2;
    backward_range(dense, emb, grad_out, grad_dense, grad_emb, b0, b1, k, d, has_dense ? 1 : 0,
                   self_interaction ? 0 : 1, width, dense_stride, emb_sample_stride,
                   emb_feature_stride, grad_sample_stride, grad_feature_stride, t, t + k * d);
    free(t);
    return 0;
#else
    (void)dense, (void)emb, (void)grad_out, (void)grad_dense, (void)grad_emb, (void)b0, (void)b1;
    (void)k, (void)d, (void)has_dense, (void)self_interaction, (void)width, (void)dense_stride;
    (void)emb_sample_stride, (void)emb_feature_stride, (void)grad_sample_stride;
    (void)grad_feature_stride;
    return -1;
#endif
}
