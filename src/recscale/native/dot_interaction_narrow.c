/*
 * The dot interaction for narrow vectors on AVX-512: d = 16 or 32 and at most 32 vectors
 * a sample (config A's and the default model's 27 x 16). Same contract as
 * recscale_dot_forward / recscale_dot_backward in dot_interaction.c. Its entry points
 * (recscale_dot_*_avx512) are the AVX-512 interaction for any d: these kernels where they
 * apply, the wide tiles of dot_interaction_avx512.c otherwise, -1 where neither does
 * (no AVX-512, or d neither 16, 32 with k <= 32, nor a multiple of 16 from 64).
 *
 * Why: at d = 16 a vector is one AVX-512 register, so a pair's dot product is one FMA and
 * a horizontal sum; the AVX2 pair kernel's sums (14 shuffles for 8 products, all on the
 * one shuffle port) set its pace, and its backward spends two 8-float FMAs a coefficient.
 * Here the forward has no horizontal sums and the backward one FMA a coefficient
 * (docs/performance.md has the times).
 *
 * Forward, per sample. Tt = T's transpose, [d][32] floats on the stack (vectors past k
 * zero), made by 16 x 16 transposes in registers. Row r of the Gram matrix is
 *
 *     G[r] = sum over c of T[r][c] * Tt[c]      (one FMA a (r, c, half of 16 j's))
 *
 * with T[r][c] a broadcast memory operand: rows 0-15 over both halves (j < 16, j >= 16),
 * rows 16-31 over the upper half alone (their pairs have j >= r >= 16). A row's pairs
 * (j >= r + offset, j < k) leave through two masked stores straight into the output row:
 *
 *     out[b][col(r, j)] = G[r][j],   col(r, j) = first + start[r] + j - r - offset
 *
 * Backward, per sample: grad_T[r] = sum over j of G[r][j] T[j], each coefficient read in
 * place from the gradient row g as a broadcast operand - G[r][j] = g[col(min, max)], a
 * self pair 2 g[col(r, r)] (offset 0) or nothing (offset 1) - in groups of rows that
 * keep 8 FMA chains apart (8 rows at d = 16, 4 at d = 32), then smaller groups for the
 * rows left. Row 0 with dense features adds the pass-through gradient g[0 .. d).
 *
 * bf (dot_interaction_bf16.c's bf16 pooled vectors): T's rows are bf16, widened exactly
 * into a sample's fp32 copy (tw, in L1) that both directions then read as above; the
 * backward's gradient rows are stored rounded to bf16 as torch casts. Every sum is the
 * fp32 kernel's on the widened rows, bit for bit.
 */
#include <stdint.h>

#include "bf16_bits.h"
#include "recscale_native.h"

/* x86-64 only: its callers (dot_interaction.c, dot_interaction_bf16.c) call it there. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_AVX512 __attribute__((target("avx512f")))
#define RS_KERNEL RS_AVX512 static inline __attribute__((always_inline))

enum { KMAX = 32 };

/* &o[i] for an index that may fall before the row: only masked-off lanes touch it. */
static inline float *at(float *o, int64_t i) {
    return (float *)((uintptr_t)o + (uintptr_t)(i * (int64_t)sizeof(float)));
}

/* base[r] such that col(r, j) = base[r] + j; returns the column past the last pair. */
static inline int64_t pair_bases(int64_t *base, int64_t k, int64_t first, int64_t offset) {
    int64_t p = first;
    for (int64_t r = 0; r < k; ++r) {
        base[r] = p - r - offset;
        p += k - r - offset;
    }
    return p;
}

/* Sample b's rows of T into rows[0 .. k): in place (fp32), or widened exactly into tw
 * ([KMAX][D], bf: bf16 rows). With rows B d values apart (feature-major) the next
 * sample's are fetched meanwhile (too many streams for the hardware prefetcher). */
RS_KERNEL void sample_rows(const float **rows, float *tw, const void *dense, const void *emb,
                           int64_t b, int64_t b1, int64_t k, const int D, int64_t e0, int64_t dsb,
                           int64_t esb, int64_t esf, const int bf) {
    const int64_t es = bf ? 2 : 4; /* bytes a value */
    for (int64_t r = 0; r < k; ++r) {
        const char *src = r < e0 ? (const char *)dense + b * dsb * es
                                 : (const char *)emb + (b * esb + (r - e0) * esf) * es;
        if (!bf) {
            rows[r] = (const float *)src;
            continue;
        }
        for (int c = 0; c < D; c += 16)
            _mm512_store_ps(tw + r * D + c,
                            rs_bf16_widen16(_mm256_loadu_si256((const __m256i *)src + c / 16)));
        rows[r] = tw + r * D;
    }
    if (esf != D && b + 1 < b1)
        for (int64_t f = 0; f < k - e0; ++f)
            _mm_prefetch((const char *)emb + ((b + 1) * esb + f * esf) * es, _MM_HINT_T0);
}

/* 16 gradient values to dst[i ..]: fp32, or rounded to bf16 (bf) as torch rounds. */
RS_KERNEL void store16(void *dst, int64_t i, __m512 v, const int bf) {
    if (bf) _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), rs_bf16_round16(v));
    else _mm512_storeu_ps((float *)dst + i, v);
}

/* v[0..15] (16 rows of 16 floats) -> their transpose: v[c] lane i = old v[i] lane c. */
RS_KERNEL void transpose16(__m512 *v) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* a lane: [v_i[e], v_i+1[e], v_i[e+1], v_i+1[e+1]] */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    __m512 u[16]; /* u[4 g + e], 128-bit lane q: element 4 q + e of rows 4 g .. 4 g + 3 */
    for (int g = 0; g < 4; ++g) {
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int e = 0; e < 4; ++e) { /* element 4 q + e of all 16 rows from lane q of 4 u's */
        const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88); /* lanes 0, 2 */
        const __m512 w1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD); /* lanes 1, 3 */
        const __m512 x0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 x1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        v[e] = _mm512_shuffle_f32x4(w0, x0, 0x88);
        v[4 + e] = _mm512_shuffle_f32x4(w1, x1, 0x88);
        v[8 + e] = _mm512_shuffle_f32x4(w0, x0, 0xDD);
        v[12 + e] = _mm512_shuffle_f32x4(w1, x1, 0xDD);
    }
}

/* tt[c][j] = rows[j][c] for c < D, j < 32 (rows past k read as zero). */
RS_KERNEL void fill_tt(float *tt, const float *const *rows, int64_t k, const int D) {
    for (int cc = 0; cc < D / 16; ++cc)
        for (int rb = 0; rb < 2; ++rb) {
            __m512 v[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t r = 16 * rb + i;
                v[i] = r < k ? _mm512_loadu_ps(rows[r] + 16 * cc) : _mm512_setzero_ps();
            }
            transpose16(v);
            for (int c = 0; c < 16; ++c)
                _mm512_store_ps(tt + (16 * cc + c) * KMAX + 16 * rb, v[c]);
        }
}

/* Rows [r0, r0 + 8) of G (rows past k read the zero row and are not stored); lo: the
 * lower half of j too. Their pairs to o at col(r, j) = base[r] + j. */
RS_KERNEL void gram_rows(const float *const *rows, const float *tt, float *o,
                         const int64_t *base, int64_t k, int64_t r0, const int lo, const int D,
                         int64_t offset) {
    __m512 acc[8][2];
    for (int u = 0; u < 8; ++u) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
    const float *r[8];
    for (int u = 0; u < 8; ++u) r[u] = rows[r0 + u];
    for (int c = 0; c < D; ++c) {
        const __m512 low = _mm512_load_ps(tt + c * KMAX);
        const __m512 high = _mm512_load_ps(tt + c * KMAX + 16);
        for (int u = 0; u < 8; ++u) {
            const __m512 a = _mm512_set1_ps(r[u][c]);
            if (lo) acc[u][0] = _mm512_fmadd_ps(a, low, acc[u][0]);
            acc[u][1] = _mm512_fmadd_ps(a, high, acc[u][1]);
        }
    }
    for (int u = 0; u < 8 && r0 + u < k; ++u) {
        const int64_t i = r0 + u, from = i + offset; /* the row's pairs: j in [from, k) */
        for (int h = lo ? 0 : 1; h < 2; ++h) {
            const int64_t a = from > 16 * h ? from - 16 * h : 0, z = k - 16 * h;
            if (z <= a) continue;
            const unsigned below_z = z >= 16 ? 0xFFFFu : (1u << z) - 1u;
            const __mmask16 m = (__mmask16)(below_z & ~((1u << a) - 1u));
            _mm512_mask_storeu_ps(at(o, base[i] + 16 * h), m, acc[u][h]);
        }
    }
}

RS_KERNEL void forward_narrow(const void *dense, const void *emb, float *out, int64_t b0,
                              int64_t b1, int64_t k, const int D, int64_t e0, int64_t offset,
                              int64_t width, int64_t dsb, int64_t esb, int64_t esf, const int bf) {
    float tt[KMAX * KMAX] __attribute__((aligned(64)));
    float tw[KMAX * KMAX] __attribute__((aligned(64)));
    static const float zero_row[KMAX] __attribute__((aligned(64)));
    const float *rows[KMAX];
    int64_t base[KMAX];
    const int64_t end = pair_bases(base, k, e0 * D, offset);
    for (int64_t r = k; r < KMAX; ++r) rows[r] = zero_row;
    for (int64_t b = b0; b < b1; ++b) {
        float *o = out + b * width;
        sample_rows(rows, tw, dense, emb, b, b1, k, D, e0, dsb, esb, esf, bf);
        fill_tt(tt, rows, k, D);
        /* lo a constant at each call: a runtime one kept a branch and a spilled
         * accumulator in the loop (a store-to-load chain: 2.5x its time) */
        gram_rows(rows, tt, o, base, k, 0, 1, D, offset);
        if (k > 8) gram_rows(rows, tt, o, base, k, 8, 1, D, offset);
        if (k > 16) gram_rows(rows, tt, o, base, k, 16, 0, D, offset);
        if (k > 24) gram_rows(rows, tt, o, base, k, 24, 0, D, offset);
        if (e0)
            for (int c = 0; c < D; c += 16) _mm512_storeu_ps(o + c, _mm512_loadu_ps(rows[0] + c));
        for (int64_t c = end; c < width; c += 16) {
            const int64_t n = width - c;
            const __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
            _mm512_mask_storeu_ps(o + c, m, _mm512_setzero_ps());
        }
    }
}

/* Rows [r0, r0 + R) of grad_T (all < k): coefficients from gb at col(min, max). */
RS_KERNEL void grad_rows(const float *const *rows, const float *gb, const int64_t *base, int64_t k,
                         int64_t r0, const int R, const int D, int64_t offset, int64_t e0,
                         void *gd_b, void *ge_b, int64_t gsf, const int bf) {
    enum { W_MAX = 2 };
    const int W = D / 16;
    __m512 acc[8][W_MAX], tj[W_MAX];
    for (int u = 0; u < R; ++u)
        for (int w = 0; w < W; ++w) acc[u][w] = _mm512_setzero_ps();
#define RS_TERM(u, COEF)                                                                  \
    {                                                                                     \
        const __m512 a = _mm512_set1_ps(COEF);                                            \
        for (int w = 0; w < W; ++w) acc[u][w] = _mm512_fmadd_ps(a, tj[w], acc[u][w]);     \
    }
    for (int64_t j = 0; j < r0; ++j) { /* below the group: G[r][j] = g[col(j, r)] */
        for (int w = 0; w < W; ++w) tj[w] = _mm512_loadu_ps(rows[j] + 16 * w);
        const float *cp = gb + base[j] + r0;
        for (int u = 0; u < R; ++u) RS_TERM(u, cp[u])
    }
#pragma GCC unroll 8
    for (int v = 0; v < R; ++v) { /* inside: either side of the diagonal, and on it */
        const int64_t j = r0 + v;
        for (int w = 0; w < W; ++w) tj[w] = _mm512_loadu_ps(rows[j] + 16 * w);
#pragma GCC unroll 8
        for (int u = 0; u < R; ++u) {
            if (u < v) RS_TERM(u, gb[base[r0 + u] + j])
            else if (u > v) RS_TERM(u, gb[base[j] + r0 + u])
            else if (!offset) RS_TERM(u, 2.0f * gb[base[j] + j])
        }
    }
    const float *rp[8];
    for (int u = 0; u < R; ++u) rp[u] = gb + base[r0 + u];
    for (int64_t j = r0 + R; j < k; ++j) { /* above: G[r][j] = g[col(r, j)] */
        for (int w = 0; w < W; ++w) tj[w] = _mm512_loadu_ps(rows[j] + 16 * w);
        for (int u = 0; u < R; ++u) RS_TERM(u, rp[u][j])
    }
#undef RS_TERM
    for (int u = 0; u < R; ++u) {
        const int64_t r = r0 + u;
        for (int w = 0; w < W; ++w) {
            if (r < e0) /* the dense row: plus its pass-through gradient */
                store16(gd_b, 16 * w, _mm512_add_ps(acc[u][w], _mm512_loadu_ps(gb + 16 * w)), bf);
            else
                store16(ge_b, (r - e0) * gsf + 16 * w, acc[u][w], bf);
        }
    }
}

RS_KERNEL void backward_narrow(const void *dense, const void *emb, const float *g,
                               void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                               int64_t k, const int D, int64_t e0, int64_t offset, int64_t width,
                               int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                               const int bf) {
    float tw[KMAX * KMAX] __attribute__((aligned(64)));
    const float *rows[KMAX];
    int64_t base[KMAX];
    pair_bases(base, k, e0 * D, offset);
    const int RB = D == 16 ? 8 : 4; /* 8 FMA chains */
    const int64_t es = bf ? 2 : 4;
    for (int64_t b = b0; b < b1; ++b) {
        const float *gb = g + b * width;
        sample_rows(rows, tw, dense, emb, b, b1, k, D, e0, dsb, esb, esf, bf);
        void *gd_b = e0 ? (char *)grad_dense + b * D * es : 0;
        void *ge_b = (char *)grad_emb + b * gsb * es;
#define RS_GROUP(R) grad_rows(rows, gb, base, k, r0, R, D, offset, e0, gd_b, ge_b, gsf, bf)
        int64_t r0 = 0;
        for (; r0 + RB <= k; r0 += RB) {
            if (RB == 8) RS_GROUP(8);
            else RS_GROUP(4);
        }
        switch (k - r0) { /* the rows left in one group: its chains side by side */
        case 7: RS_GROUP(7); break;
        case 6: RS_GROUP(6); break;
        case 5: RS_GROUP(5); break;
        case 4: RS_GROUP(4); break;
        case 3: RS_GROUP(3); break;
        case 2: RS_GROUP(2); break;
        case 1: RS_GROUP(1); break;
        default: break;
        }
#undef RS_GROUP
    }
}

static int narrow_applies(int64_t k, int64_t d) {
    return (d == 16 || d == 32) && k >= 1 && k <= KMAX &&
           (recscale_cpu_features() & RS_CPU_AVX512F);
}

/* The AVX-512 forward for any d: these kernels where they apply, else the wide tiles
 * (dot_interaction_avx512.c; -1 where neither does). bf: dense and emb bf16 (the output
 * stays fp32). */
RS_AVX512 int recscale_dot_forward_avx512(const void *dense, const void *emb, float *out,
                                          int64_t b0, int64_t b1, int64_t k, int64_t d,
                                          int64_t e0, int64_t offset, int64_t width, int64_t dsb,
                                          int64_t esb, int64_t esf, int64_t bf) {
    if (!narrow_applies(k, d))
        return recscale_dot_forward_wide(dense, emb, out, b0, b1, k, d, e0, offset, width, dsb,
                                         esb, esf, bf);
#define RS_FWD(D, BF) \
    forward_narrow(dense, emb, out, b0, b1, k, D, e0, offset, width, dsb, esb, esf, BF)
    if (d == 16 && bf) RS_FWD(16, 1);
    else if (d == 16) RS_FWD(16, 0);
    else if (bf) RS_FWD(32, 1);
    else RS_FWD(32, 0);
#undef RS_FWD
    return 0;
}

/* The AVX-512 backward for any d, as the forward; bf: dense, emb, grad_dense and
 * grad_emb bf16 (g stays fp32). */
RS_AVX512 int recscale_dot_backward_avx512(const void *dense, const void *emb, const float *g,
                                           void *grad_dense, void *grad_emb, int64_t b0,
                                           int64_t b1, int64_t k, int64_t d, int64_t e0,
                                           int64_t offset, int64_t width, int64_t dsb,
                                           int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                                           int64_t bf) {
    if (!narrow_applies(k, d))
        return recscale_dot_backward_wide(dense, emb, g, grad_dense, grad_emb, b0, b1, k, d, e0,
                                          offset, width, dsb, esb, esf, gsb, gsf, bf);
#define RS_BWD(D, BF)                                                                         \
    backward_narrow(dense, emb, g, grad_dense, grad_emb, b0, b1, k, D, e0, offset, width, dsb, \
                    esb, esf, gsb, gsf, BF)
    if (d == 16 && bf) RS_BWD(16, 1);
    else if (d == 16) RS_BWD(16, 0);
    else if (bf) RS_BWD(32, 1);
    else RS_BWD(32, 0);
#undef RS_BWD
    return 0;
}

#endif
