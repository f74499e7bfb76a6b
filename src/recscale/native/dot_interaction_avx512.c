/*
 * The dot interaction's forward for wide vectors (d a multiple of 16, d >= 64: config
 * B's d = 128) on AVX-512: same contract as recscale_dot_forward in dot_interaction.c,
 * which calls this when it applies.
 *
 * Why: the AVX2 kernel takes one pair at a time, loading both vectors for every FMA;
 * with d = 128 neither row fits in its registers, so it is load-bound (2 loads an FMA)
 * and spills (B: 4.1-4.5 ms for 2048 x 27 x 128 on 2 threads). Here the pairs go in 4 x 4
 * tiles of rows (I, J), 16 accumulators: per 16 floats of d, 8 loads feed 16 FMAs, so
 * the FMA pipe sets the pace. The 16 accumulators are then summed across their lanes in
 * one tree of shuffles (45 ops for 16 dot products), and the tile's pairs with j > i
 * (j >= i with self_interaction) are stored in triu order. The rows are read in place
 * (dense row, then the sample's embedding rows at their strides; rows past k read a zero
 * row), and the next sample's rows are prefetched over the current sample's tiles.
 *
 * bf (dot_interaction_bf16.c's bf16 pooled vectors): T's rows are bf16, widened exactly
 * as they are loaded, and the backward's gradient rows are stored in bf16 (rounded to
 * nearest even as torch casts); the sums, G and the output rows stay fp32: every sum is
 * the fp32 kernel's on the widened rows, bit for bit. Each element type is its own
 * instance of the same code (bf is a constant in the inlined kernels).
 */
#include <stdint.h>

#include "bf16_bits.h"
#include "recscale_native.h"
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_AVX512 __attribute__((target("avx512f")))
#define RS_KERNEL RS_AVX512 static inline __attribute__((always_inline))

/* The backward writes a part's gradient rows with non-temporal stores when they come to
 * at least this many bytes (tests set 0 to reach those stores at any size). Config B's
 * 27 MB of embedding gradients (2048 x 27 x 128 fp32) would not stay in the caches until
 * the sparse update reads them, and a plain store first reads each line it writes
 * (write-allocate): streamed, B's bf16 step 93.0 -> 91.4 ms (docs/performance.md). */
int64_t recscale_dot_stream_bytes = (int64_t)8 << 20;
/* The samples whose rows the caller's whole part writes, when it calls the backward in
 * blocks (dot_interaction_bf16.c): the streaming test is of the part, not the block.
 * 0: the call's own range. */
_Thread_local int64_t rs_dot_part_samples = 0;


/* Share `part` of `parts` of the 64-byte lines of a sample's embedding rows (row f at
 * byte e + f * esf, `row_bytes` each: `lines` in all, `per_row` a row) into the L1: spread
 * over a sample's work, they arrive before the next sample needs them. */
static inline void prefetch_share(const char *e, int64_t esf, int64_t row_bytes, int64_t per_row,
                                  int64_t lines, int64_t part, int64_t parts) {
    for (int64_t l = lines * part / parts; l < lines * (part + 1) / parts; ++l) {
        const int64_t at = 64 * (l % per_row);
        _mm_prefetch(e + (l / per_row) * esf + (at < row_bytes ? at : row_bytes - 1), _MM_HINT_T0);
    }
}

/* 16 values of a row from element c: fp32, or bf16 widened exactly (bf) */
RS_KERNEL __m512 load16(const void *row, int64_t c, const int bf) {
    if (bf) return rs_bf16_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c)));
    return _mm512_loadu_ps((const float *)row + c);
}

/* r[4 v + u] = sum of the lanes of a[4 u + v] (u, v < 4). */
RS_AVX512 static inline __m512 sum16(const __m512 *a) {
    __m512 x[8], y[4];
    for (int n = 0; n < 8; ++n) /* 128-bit lanes: [a0 q0+q2, a0 q1+q3, a1 q0+q2, a1 q1+q3] */
        x[n] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0xEE));
    for (int m = 0; m < 4; ++m) /* lane q of y[m]: 4 partial sums of a[4 m + q] */
        y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xDD));
    const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
    const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
    /* lane q, element e: sum of a[4 e + q] */
    return _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* acc[4 u + v] = <rows[u], cols[v]> over d values (a multiple of 16; D a constant). */
RS_KERNEL __m512 tile(const void *const *ri, const void *const *rj, const int64_t d, const int bf) {
    __m512 acc[16];
    for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
        __m512 a[4], b[4];
        for (int u = 0; u < 4; ++u) a[u] = load16(ri[u], c, bf);
        for (int v = 0; v < 4; ++v) b[v] = load16(rj[v], c, bf);
        for (int u = 0; u < 4; ++u)
            for (int v = 0; v < 4; ++v) acc[4 * u + v] = _mm512_fmadd_ps(a[u], b[v], acc[4 * u + v]);
    }
    return sum16(acc);
}

RS_KERNEL void forward_wide(const void *dense, const void *emb, float *out, int64_t b0,
                            int64_t b1, int64_t k, const int64_t d, int64_t e0, int64_t offset,
                            int64_t width, int64_t dsb, int64_t esb, int64_t esf,
                            const float *zero, const void **rows, int64_t *start, const int bf) {
    const int64_t kp = (k + 3) & ~(int64_t)3, nb = kp / 4, first = e0 * d;
    const int64_t es = bf ? 2 : 4, row_bytes = d * es, per_row = (row_bytes + 63) / 64;
    const char *dn = (const char *)dense, *em = (const char *)emb;
    /* start[i]: the column of pair (i, i + offset) */
    for (int64_t i = 0, p = first; i < k; ++i) {
        start[i] = p;
        p += k - i - offset;
    }
    const int64_t npairs = k * (k - 2 * offset + 1) / 2;
    const int64_t lines = (k - e0) * per_row, ntiles = nb * (nb + 1) / 2;
    for (int64_t b = b0; b < b1; ++b) {
        float *o = out + b * width;
        if (e0) rows[0] = dn + b * dsb * es;
        for (int64_t f = 0; f < k - e0; ++f) rows[e0 + f] = em + (b * esb + f * esf) * es;
        for (int64_t r = k; r < kp; ++r) rows[r] = zero; /* zero bits: 0 in either type */
        if (e0)
            for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(o + c, load16(rows[0], c, bf));
        int64_t t = 0;
        for (int64_t I = 0; I < nb; ++I)
            for (int64_t J = I; J < nb; ++J, ++t) {
                if (b + 1 < b1)
                    prefetch_share(em + (b + 1) * esb * es, esf * es, row_bytes, per_row, lines, t,
                                   ntiles);
                float s[16] __attribute__((aligned(64)));
                _mm512_store_ps(s, tile(rows + 4 * I, rows + 4 * J, d, bf));
                for (int64_t u = 0; u < 4; ++u) {
                    const int64_t i = 4 * I + u;
                    if (i >= k) break;
                    for (int64_t v = 0; v < 4; ++v) {
                        const int64_t j = 4 * J + v;
                        if (j < i + offset || j >= k) continue;
                        o[start[i] + j - i - offset] = s[4 * v + u];
                    }
                }
            }
        for (int64_t p = first + npairs; p < width; ++p) o[p] = 0.0f;
    }
}

/* Returns 0, -1 when it does not apply (no AVX-512, d not a multiple of 16 or < 64: the
 * caller runs its own kernel), -2 when out of memory. bf: dense and emb bf16. */
RS_AVX512 int recscale_dot_forward_wide(const void *dense, const void *emb, float *out,
                                        int64_t b0, int64_t b1, int64_t k, int64_t d,
                                        int64_t e0, int64_t offset, int64_t width, int64_t dsb,
                                        int64_t esb, int64_t esf, int64_t bf) {
    if (d % 16 != 0 || d < 64 || !(recscale_cpu_features() & RS_CPU_AVX512F)) return -1;
    float *zero;
    const void **rows;
    int64_t *start;
    if (recscale_tile_scratch(k, d, &zero, (const float ***)&rows, &start)) return -2;
#define RS_FWD(D, BF) \
    forward_wide(dense, emb, out, b0, b1, k, D, e0, offset, width, dsb, esb, esf, zero, rows, start, BF)
    if (bf && d == 128) RS_FWD(128, 1);
    else if (bf) RS_FWD(d, 1);
    else if (d == 128) RS_FWD(128, 0);
    else if (d == 64) RS_FWD(64, 0);
    else RS_FWD(d, 0);
#undef RS_FWD
    recscale_tile_scratch_free(zero, (const float **)rows, start);
    return 0;
}

/* Rows [i0, i0 + 4) of grad_T = G @ T, columns [c, c + 16 nq) (nq a constant <= 4): 16
 * accumulators; per row j of T, nq loads and 4 broadcasts of G feed 4 nq FMAs. G holds
 * the upper triangle and diagonal (kp x kp, zero past k): the coefficient of (r, j) is
 * G[r][j] for j >= r and G[j][r] below, so j runs in three ranges of fixed addressing.
 * bf: T's rows and the gradient rows (dst) are bf16. */
RS_KERNEL void grad_block(const float *restrict G, int64_t kp, const void *const *rows, int64_t k,
                          int64_t i0, int64_t c, const int nq, void *const *dst,
                          const float *gpass, int64_t e0, int stream, const int bf) {
    __m512 acc[4][4];
    for (int u = 0; u < 4; ++u)
        for (int q = 0; q < nq; ++q) acc[u][q] = _mm512_setzero_ps();
#define RS_J(ADDR)                                                                          \
    {                                                                                       \
        __m512 tj[4];                                                                       \
        for (int q = 0; q < nq; ++q) tj[q] = load16(rows[j], c + 16 * q, bf);              \
        for (int u = 0; u < 4; ++u) {                                                       \
            const __m512 gv = _mm512_set1_ps(G[ADDR]);                                      \
            for (int q = 0; q < nq; ++q) acc[u][q] = _mm512_fmadd_ps(gv, tj[q], acc[u][q]); \
        }                                                                                   \
    }
    int64_t j = 0;
    const int64_t mid = i0 + 4 < k ? i0 + 4 : k;
    for (; j < i0 && j < k; ++j) RS_J(j * kp + i0 + u)
    for (; j < mid; ++j) RS_J(i0 + u <= j ? (i0 + u) * kp + j : j * kp + i0 + u)
    for (; j < k; ++j) RS_J((i0 + u) * kp + j)
#undef RS_J
    for (int u = 0; u < 4; ++u) {
        const int64_t r = i0 + u;
        if (r >= k) break;
        for (int q = 0; q < nq; ++q) {
            __m512 v = acc[u][q];
            if (r < e0) v = _mm512_add_ps(v, _mm512_loadu_ps(gpass + c + 16 * q));
            if (bf) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst[r] + c + 16 * q), rs_bf16_round16(v));
                continue;
            }
            float *o = (float *)dst[r] + c + 16 * q;
            if (stream && ((uintptr_t)o & 63) == 0)
                _mm512_stream_ps(o, v);
            else
                _mm512_storeu_ps(o, v);
        }
    }
}

RS_KERNEL void backward_wide(const void *dense, const void *emb, const float *g,
                             void *grad_dense, void *grad_emb, int64_t b0, int64_t b1, int64_t k,
                             const int64_t d, int64_t e0, int64_t offset, int64_t width,
                             int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                             float *G, int64_t kp, const void **rows, void **dst, const int bf) {
    const int64_t es = bf ? 2 : 4, row_bytes = d * es, per_row = (row_bytes + 63) / 64;
    const int64_t first = e0 * d, lines = (k - e0) * per_row, ngroups = kp / 4;
    const int64_t steps = ngroups * ((d + 63) / 64);
    const int64_t part = rs_dot_part_samples > 0 ? rs_dot_part_samples : b1 - b0;
    /* bf16 rows: plain stores (the caller's blocks are small, and the rows half as big) */
    const int stream = !bf && part * k * d * (int64_t)sizeof(float) >= recscale_dot_stream_bytes;
    const char *dn = (const char *)dense, *em = (const char *)emb;
    char *gdn = (char *)grad_dense, *gem = (char *)grad_emb;
    for (int64_t b = b0; b < b1; ++b) {
        const float *gb = g + b * width;
        if (e0) {
            rows[0] = dn + b * dsb * es;
            dst[0] = gdn + b * d * es;
        }
        for (int64_t f = 0; f < k - e0; ++f) {
            rows[e0 + f] = em + (b * esb + f * esf) * es;
            dst[e0 + f] = gem + (b * gsb + f * gsf) * es;
        }
        /* G's upper triangle and diagonal: row i's pairs are contiguous in g */
        for (int64_t i = 0, p = first; i < k; ++i) {
            const int64_t n = k - i - offset;
            float *row = G + i * kp + i;
            if (offset) row[0] = 0.0f;
            memcpy(row + offset, gb + p, (size_t)n * sizeof(float));
            p += n;
            if (!offset) row[0] *= 2.0f; /* d<T_i, T_i>/dT_i = 2 T_i (self_interaction) */
        }
        int64_t step = 0;
        for (int64_t c = 0; c < d; c += 64)
            for (int64_t i0 = 0; i0 < kp; i0 += 4, ++step) {
                if (b + 1 < b1)
                    prefetch_share(em + (b + 1) * esb * es, esf * es, row_bytes, per_row, lines,
                                   step, steps);
                switch (d - c >= 64 ? 4 : (d - c) / 16) {
                case 4: grad_block(G, kp, rows, k, i0, c, 4, dst, gb, e0, stream, bf); break;
                case 3: grad_block(G, kp, rows, k, i0, c, 3, dst, gb, e0, stream, bf); break;
                case 2: grad_block(G, kp, rows, k, i0, c, 2, dst, gb, e0, stream, bf); break;
                default: grad_block(G, kp, rows, k, i0, c, 1, dst, gb, e0, stream, bf); break;
                }
            }
    }
}

/* The backward of recscale_dot_forward_wide (same contract as recscale_dot_backward);
 * returns as it does. bf: dense, emb, grad_dense and grad_emb bf16 (g stays fp32). */
RS_AVX512 int recscale_dot_backward_wide(const void *dense, const void *emb, const float *g,
                                         void *grad_dense, void *grad_emb, int64_t b0,
                                         int64_t b1, int64_t k, int64_t d, int64_t e0,
                                         int64_t offset, int64_t width, int64_t dsb, int64_t esb,
                                         int64_t esf, int64_t gsb, int64_t gsf, int64_t bf) {
    if (d % 16 != 0 || d < 64 || !(recscale_cpu_features() & RS_CPU_AVX512F)) return -1;
    const int64_t kp = (k + 3) & ~(int64_t)3;
    float *G = calloc((size_t)(kp * kp), sizeof(float)); /* past k: zero, never written */
    const void **rows = malloc((size_t)kp * sizeof(void *));
    void **dst = malloc((size_t)kp * sizeof(void *));
    int rc = -2;
    if (G && rows && dst) {
#define RS_BWD(D, BF)                                                                         \
    backward_wide(dense, emb, g, grad_dense, grad_emb, b0, b1, k, D, e0, offset, width, dsb, \
                  esb, esf, gsb, gsf, G, kp, rows, dst, BF)
        if (bf && d == 128) RS_BWD(128, 1);
        else if (bf) RS_BWD(d, 1);
        else if (d == 128) RS_BWD(128, 0);
        else RS_BWD(d, 0);
#undef RS_BWD
        _mm_sfence(); /* the streamed stores visible before the caller reads them */
        rc = 0;
    }
    free(G);
    free(rows);
    free(dst);
    return rc;
}

#else
int recscale_dot_forward_wide(const void *dense, const void *emb, float *out, int64_t b0,
                              int64_t b1, int64_t k, int64_t d, int64_t e0, int64_t offset,
                              int64_t width, int64_t dsb, int64_t esb, int64_t esf, int64_t bf) {
    (void)dense, (void)emb, (void)out, (void)b0, (void)b1, (void)k, (void)d, (void)e0;
    (void)offset, (void)width, (void)dsb, (void)esb, (void)esf, (void)bf;
    return -1;
}
int recscale_dot_backward_wide(const void *dense, const void *emb, const float *g,
                               void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                               int64_t k, int64_t d, int64_t e0, int64_t offset, int64_t width,
                               int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                               int64_t bf) {
    (void)dense, (void)emb, (void)g, (void)grad_dense, (void)grad_emb, (void)b0, (void)b1;
    (void)k, (void)d, (void)e0, (void)offset, (void)width, (void)dsb, (void)esb, (void)esf;
    (void)gsb, (void)gsf, (void)bf;
    return -1;
}
#endif
