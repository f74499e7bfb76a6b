/*
 * Fused embedding backward + sparse optimizer (the C twin of embedding/cpu_kernels.py).
 *
 * For each segment s in [s0, s1) (a segment = the ids of one feature; no row appears in
 * two segments, so threads given disjoint segment ranges never race):
 *
 *     merge duplicate rows with an open-addressing hash map, summing
 *         acc[u] += grad_pooled[bag_of_id[n]] * psw[n]        (psw = 1 when absent);
 *     (row-wise Adagrad) each unique row's step size, in a pass over the rows' state
 *     of its own (adagrad_scales);
 *     apply the optimizer to every unique row in place, prefetching the rows (and Adam's
 *     state) a fixed distance ahead:
 *         SGD:               w -= lr * acc
 *         row-wise Adagrad:  s += mean(acc^2);  w -= lr / (sqrt(s) + eps) * acc
 *         lazy Adam:         m = b1 m + (1 - b1) acc;  v = b2 v + (1 - b2) acc^2;
 *                            w -= step_size * m / (sqrt(v) + eps)
 *
 * Rows stored as fp16 / bf16 (`wt`, row_format.h) are read into fp32, updated there and
 * stored back with stochastic rounding whose noise hashes (step, row, column).
 *
 * Layouts (row-major): weight [R, d] (fp32, fp16 or bf16); fp32 Adagrad state1 [R];
 * Adam state1/state2 [R, d]; grad_pooled [num_bags, d] (fp32, or bf16 with grad_bf16: a bf16
 * consumer's gradient, each value widened exactly) with row stride `grad_stride`; rows, seg_starts,
 * bag_of_id int64; dirty uint8 [R] or NULL.
 *
 * Why C: the numba kernel's loops over d = 16 stay scalar (too short for the loop
 * vectorizer), and numba has no prefetch, so it needs a separate touch pass over the
 * rows to overlap the cache misses.
 */
#include <math.h>
#include <stdint.h>

#include "recscale_native.h"
#include <stdlib.h>
#include <string.h>

#include "row_format.h"

#define RS_SGD 0
#define RS_ADAGRAD 1
#define RS_ADAM 2

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RS_INLINE RS_AVX2 static inline __attribute__((always_inline))

/* acc[0 .. d) += g[0 .. d) * w (d a multiple of 8) for a gradient row of format gwt
 * (RS_F32, or RS_BF16 widened exactly; a constant at each call) */
RS_INLINE void axpy(float *restrict acc, const void *restrict g, float w, const int64_t d,
                    const int gwt) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t c = 0; c < d; c += 8)
        _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(rs_load8(g, c, gwt), wv,
                                                  _mm256_loadu_ps(acc + c)));
}

RS_INLINE float sum_sq(const float *restrict a, const int64_t d) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 v = _mm256_loadu_ps(a + c);
        s = _mm256_fmadd_ps(v, v, s);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* w -= scale * a */
RS_INLINE void sub_scaled(float *restrict w, const float *restrict a, float scale, const int64_t d) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t c = 0; c < d; c += 8)
        _mm256_storeu_ps(w + c, _mm256_fnmadd_ps(sv, _mm256_loadu_ps(a + c), _mm256_loadu_ps(w + c)));
}

typedef struct {
    int kind;
    void *weight;
    float *state1, *state2;
    const int64_t *rows, *seg_starts, *bag_of_id;
    const float *psw;
    const void *grad; /* fp32, or bf16 with grad_bf16 */
    int64_t grad_stride;
    float lr, eps, beta1, beta2, step_size;
    uint8_t *dirty;
    int64_t step;  /* the stochastic rounding's noise (16-bit rows) */
    uint16_t *low; /* RS_SPLIT: the values' low 16 bits, beside the bf16 high halves */
    int grad_bf16; /* the pooled gradient in bf16 (a bf16 consumer's): widened as read */
} Args;

/* Scratch for one segment of up to n ids: hash keys/slots (cap = 2^k >= 2n), the unique
 * rows, their accumulated gradients and (row-wise Adagrad) their step sizes. */
typedef struct {
    int64_t cap, *keys, *slot, *uniq;
    float *acc, *scale;
} Scratch;

/* rows in flight; one thread, 53k uniform rows of a 1.7 GB table (huge pages): none
 * 4.0 ms, 16 ahead 3.0 ms, 32 ahead 2.7 ms, 64 ahead 2.6 ms */
#define RS_AHEAD 32

RS_INLINE void prefetch_row(const Args *a, int64_t r, const int64_t d, const int wt) {
    /* every line of the row (d = 128 fp32, one thread, 53k rows: 8.3 -> 6.4 ms) */
    const int64_t bytes = d * rs_value_bytes(wt);
    const char *row = (const char *)a->weight + r * bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 1, 1);
    if (wt == RS_SPLIT) /* the low halves too, a row of them as long as the high one */
        for (int64_t o = 0; o < bytes; o += 64)
            __builtin_prefetch((const char *)(a->low + r * d) + o, 1, 1);
    if (a->kind == RS_ADAM) { /* row-wise Adagrad's state: adagrad_scales prefetches it */
        __builtin_prefetch(a->state1 + r * d, 1, 1);
        __builtin_prefetch(a->state2 + r * d, 1, 1);
    }
}

/* One optimizer step on the fp32 row w (its merged gradient g, its state at row r; SGD
 * and row-wise Adagrad: w -= scale * g, the step size lr or from adagrad_scales). */
RS_INLINE void update_row(const Args *a, int64_t r, float *restrict w, const float *restrict g,
                          float scale, const int64_t d) {
    if (a->kind != RS_ADAM) {
        sub_scaled(w, g, scale, d);
    } else {
        float *m = a->state1 + r * d, *v = a->state2 + r * d;
        for (int64_t c = 0; c < d; ++c) {
            const float gc = g[c];
            m[c] = a->beta1 * m[c] + (1.0f - a->beta1) * gc;
            v[c] = a->beta2 * v[c] + (1.0f - a->beta2) * gc * gc;
            w[c] -= a->step_size * m[c] / (sqrtf(v[c]) + a->eps);
        }
    }
}

/* Each unique row's row-wise Adagrad step size, before any row is updated:
 * lr / (sqrt(s) + eps) after s += mean(g^2). A pass of its own, prefetching the state
 * further ahead than the rows: a state read that missed inside the update loop held the
 * row's whole update (it waits for the step size) in the core's reorder window, and
 * fewer rows' misses then overlapped (one thread, 53k random rows of dim 128 from a
 * 2 GB table: split rows 11.8-12.3 -> 8.1-8.6 ms, SGD's 7.5-7.7 the floor; fp32 rows,
 * whose update is shorter, 7.2-7.5 either way). */
#define RS_STATE_AHEAD 64
RS_INLINE void adagrad_scales(const Args *a, const int64_t *uniq, const float *acc, int64_t u,
                              float *scale, const int64_t d) {
    for (int64_t j = 0; j < u && j < RS_STATE_AHEAD; ++j)
        __builtin_prefetch(a->state1 + uniq[j], 1, 1);
    for (int64_t j = 0; j < u; ++j) {
        if (j + RS_STATE_AHEAD < u) __builtin_prefetch(a->state1 + uniq[j + RS_STATE_AHEAD], 1, 1);
        float *st = a->state1 + uniq[j];
        *st += sum_sq(acc + j * d, d) / (float)d;
        scale[j] = a->lr / (sqrtf(*st) + a->eps);
    }
}

/* Split rows: value k's bits are hi[k] << 16 | lw[k]. Sixteen at a time, unpacking the
 * two halves' words (unpacklo/hi_epi16) rebuilds them in 128-bit lane order - va holds
 * values 0-3 | 8-11, vb 4-7 | 12-15 - and packus_epi32 of the halves' words puts them
 * back in order. That is half the instructions of widening each half to 32 bits, and
 * out of cache the count is what costs: the fewer a row takes, the more rows' misses
 * the core overlaps (one thread, 53k random rows of dim 128 from 2 GB, the update alone:
 * 7.5-7.9 ms widened, 4.0 unpacked, fp32 rows 3.3). A row's last 8 values
 * (d % 16 == 8) go through the widening path. */
RS_INLINE void split_load16(const uint16_t *hi, const uint16_t *lw, __m256 *va, __m256 *vb) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)hi);
    const __m256i l = _mm256_loadu_si256((const __m256i *)lw);
    *va = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l, h));
    *vb = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l, h));
}

RS_INLINE void split_store16(uint16_t *hi, uint16_t *lw, __m256 va, __m256 vb) {
    const __m256i a = _mm256_castps_si256(va), b = _mm256_castps_si256(vb);
    const __m256i m = _mm256_set1_epi32(0xFFFF);
    _mm256_storeu_si256((__m256i *)hi,
                        _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)));
    _mm256_storeu_si256((__m256i *)lw,
                        _mm256_packus_epi32(_mm256_and_si256(a, m), _mm256_and_si256(b, m)));
}

RS_INLINE __m256 split_load8(const uint16_t *hi, const uint16_t *lw) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)hi));
    const __m256i l = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)lw));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(h, 16), l));
}

RS_INLINE void split_store8(uint16_t *hi, uint16_t *lw, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i h = _mm256_srli_epi32(bits, 16);
    const __m256i l = _mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF));
    _mm_storeu_si128((__m128i *)hi,
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    _mm_storeu_si128((__m128i *)lw,
                     _mm_packus_epi32(_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1)));
}

/* w -= scale * g on a split row: update_row's SGD/Adagrad arithmetic (sub_scaled). */
RS_INLINE void split_sub_scaled(uint16_t *restrict hi, uint16_t *restrict lw,
                                const float *restrict g, float scale, const int64_t d) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256 va, vb;
        split_load16(hi + c, lw + c, &va, &vb);
        const __m256 g0 = _mm256_loadu_ps(g + c), g1 = _mm256_loadu_ps(g + c + 8);
        va = _mm256_fnmadd_ps(sv, _mm256_permute2f128_ps(g0, g1, 0x20), va); /* 0-3 | 8-11 */
        vb = _mm256_fnmadd_ps(sv, _mm256_permute2f128_ps(g0, g1, 0x31), vb); /* 4-7 | 12-15 */
        split_store16(hi + c, lw + c, va, vb);
    }
    if (c < d)
        split_store8(hi + c, lw + c,
                     _mm256_fnmadd_ps(sv, _mm256_loadu_ps(g + c), split_load8(hi + c, lw + c)));
}

/* row[0 .. d) = the split row's fp32 values, in order; split_encode stores them back. */
RS_INLINE void split_decode(const uint16_t *hi, const uint16_t *lw, float *row, const int64_t d) {
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256 va, vb;
        split_load16(hi + c, lw + c, &va, &vb);
        _mm256_storeu_ps(row + c, _mm256_permute2f128_ps(va, vb, 0x20));
        _mm256_storeu_ps(row + c + 8, _mm256_permute2f128_ps(va, vb, 0x31));
    }
    if (c < d) _mm256_storeu_ps(row + c, split_load8(hi + c, lw + c));
}

RS_INLINE void split_encode(uint16_t *hi, uint16_t *lw, const float *row, const int64_t d) {
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        const __m256 r0 = _mm256_loadu_ps(row + c), r1 = _mm256_loadu_ps(row + c + 8);
        split_store16(hi + c, lw + c, _mm256_permute2f128_ps(r0, r1, 0x20),
                      _mm256_permute2f128_ps(r0, r1, 0x31));
    }
    if (c < d) split_store8(hi + c, lw + c, _mm256_loadu_ps(row + c));
}

RS_INLINE void segment(const Args *a, int64_t s, const int64_t d, const int wt, Scratch *sc) {
    const int64_t lo = a->seg_starts[s], n = a->seg_starts[s + 1] - lo;
    if (n <= 0) return;
    int64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    const int64_t mask = cap - 1;
    for (int64_t h = 0; h < cap; ++h) sc->keys[h] = -1;
    int64_t u = 0;
    for (int64_t k = 0; k < n; ++k) {
        const int64_t r = a->rows[lo + k];
        int64_t h = (int64_t)(((uint64_t)r * 2654435761u) & (uint64_t)mask);
        while (sc->keys[h] != -1 && sc->keys[h] != r) h = (h + 1) & mask;
        if (sc->keys[h] == -1) {
            sc->keys[h] = r;
            sc->slot[h] = u;
            sc->uniq[u] = r;
            memset(sc->acc + u * d, 0, (size_t)d * sizeof(float));
            ++u;
        }
        const float w = a->psw ? a->psw[lo + k] : 1.0f;
        const int64_t at = a->bag_of_id[lo + k] * a->grad_stride;
        if (a->grad_bf16)
            axpy(sc->acc + sc->slot[h] * d, (const uint16_t *)a->grad + at, w, d, RS_BF16);
        else
            axpy(sc->acc + sc->slot[h] * d, (const float *)a->grad + at, w, d, RS_F32);
    }
    for (int64_t j = 0; j < u && j < RS_AHEAD; ++j) prefetch_row(a, sc->uniq[j], d, wt);
    if (a->kind == RS_ADAGRAD) adagrad_scales(a, sc->uniq, sc->acc, u, sc->scale, d);
    float row[128]; /* a 16-bit row, decoded (d <= 128 for those) */
    for (int64_t j = 0; j < u; ++j) {
        /* rows are read-modified-written: keep RS_AHEAD of them in flight */
        if (j + RS_AHEAD < u) prefetch_row(a, sc->uniq[j + RS_AHEAD], d, wt);
        const int64_t r = sc->uniq[j];
        const float *g = sc->acc + j * d;
        const float scale = a->kind == RS_ADAGRAD ? sc->scale[j] : a->lr; /* Adam: unused */
        if (a->dirty) a->dirty[r] = 1; /* changed since the last checkpoint */
        if (wt == RS_F32) {
            update_row(a, r, (float *)a->weight + r * d, g, scale, d);
            continue;
        }
        if (wt == RS_SPLIT) { /* the exact fp32 values from both halves, and back: no rounding */
            uint16_t *hi = (uint16_t *)a->weight + r * d, *lw = a->low + r * d;
            if (a->kind != RS_ADAM) { /* w -= scale * g in registers */
                split_sub_scaled(hi, lw, g, scale, d);
                continue;
            }
            split_decode(hi, lw, row, d);
            update_row(a, r, row, g, scale, d);
            split_encode(hi, lw, row, d);
            continue;
        }
        void *stored = (uint16_t *)a->weight + r * d;
        for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(row + c, rs_load8(stored, c, wt));
        update_row(a, r, row, g, scale, d);
        rs_store_row(stored, row, d, rs_row_hash((uint64_t)a->step, (uint64_t)r), wt);
    }
}

RS_INLINE void segments_of(const Args *a, int64_t s0, int64_t s1, int64_t d, const int wt,
                           Scratch *sc) {
    for (int64_t s = s0; s < s1; ++s) {
        switch (d) { /* constant d: the vector loops unroll */
        case 8: segment(a, s, 8, wt, sc); break;
        case 16: segment(a, s, 16, wt, sc); break;
        case 32: segment(a, s, 32, wt, sc); break;
        case 64: segment(a, s, 64, wt, sc); break;
        case 128: segment(a, s, 128, wt, sc); break;
        default: segment(a, s, d, wt, sc); break;
        }
    }
}

RS_AVX2 static void segments(const Args *a, int64_t s0, int64_t s1, int64_t d, int64_t wt,
                             Scratch *sc) {
    switch (wt) { /* a constant format too */
    case RS_F16: segments_of(a, s0, s1, d, RS_F16, sc); break;
    case RS_BF16: segments_of(a, s0, s1, d, RS_BF16, sc); break;
    case RS_SPLIT: segments_of(a, s0, s1, d, RS_SPLIT, sc); break;
    default: segments_of(a, s0, s1, d, RS_F32, sc); break;
    }
}
#endif

/* 0 on success, -1 when unsupported here (no AVX2 build, d % 8 != 0, unknown kind or
 * format, a 16-bit row wider than 128), -2 when out of memory. */
int recscale_sparse_update(int64_t kind, void *weight, int64_t dim, float *state1, float *state2,
                           const int64_t *rows, const int64_t *seg_starts, int64_t s0, int64_t s1,
                           const int64_t *bag_of_id, const float *psw, const void *grad,
                           int64_t grad_stride, float lr, float eps, float beta1, float beta2,
                           float step_size, uint8_t *dirty, int64_t wt, int64_t step,
                           uint16_t *low, int64_t grad_bf16) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (dim <= 0 || dim % 8 != 0 || kind < RS_SGD || kind > RS_ADAM) return -1;
    if (wt < RS_F32 || wt > RS_SPLIT || (wt != RS_F32 && dim > 128)) return -1;
    if (wt == RS_SPLIT && !low) return -1;
    int64_t n_max = 0;
    for (int64_t s = s0; s < s1; ++s) {
        const int64_t n = seg_starts[s + 1] - seg_starts[s];
        if (n > n_max) n_max = n;
    }
    if (n_max == 0) return 0;
    int64_t cap = 16;
    while (cap < 2 * n_max) cap *= 2;
    Scratch sc;
    sc.cap = cap;
    sc.keys = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
    sc.slot = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
    sc.uniq = (int64_t *)malloc((size_t)n_max * sizeof(int64_t));
    sc.acc = (float *)malloc((size_t)(n_max * dim) * sizeof(float));
    sc.scale = (float *)malloc((size_t)n_max * sizeof(float));
    int rc = 0;
    if (!sc.keys || !sc.slot || !sc.uniq || !sc.acc || !sc.scale) {
        rc = -2;
    } else {
        const Args a = {(int)kind, weight, state1, state2, rows, seg_starts, bag_of_id, psw, grad,
                        grad_stride, lr, eps, beta1, beta2, step_size, dirty, step, low,
                        grad_bf16 != 0};
        segments(&a, s0, s1, dim, wt, &sc);
    }
    free(sc.keys);
    free(sc.slot);
    free(sc.uniq);
    free(sc.acc);
    free(sc.scale);
    return rc;
#else
    (void)kind, (void)weight, (void)dim, (void)state1, (void)state2, (void)rows, (void)seg_starts;
    (void)s0, (void)s1, (void)bag_of_id, (void)psw, (void)grad, (void)grad_stride, (void)lr;
    (void)eps, (void)beta1, (void)beta2, (void)step_size, (void)dirty, (void)wt, (void)step;
    (void)low, (void)grad_bf16;
    return -1;
#endif
}
