/*
 * Fused embedding backward + sparse optimizer (the C twin of embedding/cpu_kernels.py).
 *
 * For each segment s in [s0, s1) (a segment = the ids of one feature; no row appears in
 * two segments, so threads given disjoint segment ranges never race):
 *
 *     merge duplicate rows with an open-addressing hash map, summing
 *         acc[u] += grad_pooled[bag_of_id[n]] * psw[n]        (psw = 1 when absent);
 *     apply the optimizer to every unique row in place, prefetching the rows (and their
 *     optimizer state) a fixed distance ahead:
 *         SGD:               w -= lr * acc
 *         row-wise Adagrad:  s += mean(acc^2);  w -= lr / (sqrt(s) + eps) * acc
 *         lazy Adam:         m = b1 m + (1 - b1) acc;  v = b2 v + (1 - b2) acc^2;
 *                            w -= step_size * m / (sqrt(v) + eps)
 *
 * Layouts (fp32, row-major): weight [R, d]; Adagrad state1 [R]; Adam state1/state2
 * [R, d]; grad_pooled [num_bags, d] with row stride `grad_stride`; rows, seg_starts,
 * bag_of_id int64; dirty uint8 [R] or NULL.
 *
 * Why C: the numba kernel's loops over d = 16 stay scalar (too short for the loop
 * vectorizer), and numba has no prefetch, so it needs a separate touch pass over the
 * rows to overlap the cache misses.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RS_SGD 0
#define RS_ADAGRAD 1
#define RS_ADAM 2

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_AVX2 __attribute__((target("avx2,fma")))
#define RS_INLINE RS_AVX2 static inline __attribute__((always_inline))

/* acc[0 .. d) += g[0 .. d) * w (d a multiple of 8) */
RS_INLINE void axpy(float *restrict acc, const float *restrict g, float w, const int64_t d) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t c = 0; c < d; c += 8)
        _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(_mm256_loadu_ps(g + c), wv,
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
    float *weight, *state1, *state2;
    const int64_t *rows, *seg_starts, *bag_of_id;
    const float *psw, *grad;
    int64_t grad_stride;
    float lr, eps, beta1, beta2, step_size;
    uint8_t *dirty;
} Args;

/* Scratch for one segment of up to n ids: hash keys/slots (cap = 2^k >= 2n), the unique
 * rows and their accumulated gradients. */
typedef struct {
    int64_t cap, *keys, *slot, *uniq;
    float *acc;
} Scratch;

/* rows in flight; one thread, 53k uniform rows of a 1.7 GB table (huge pages): none
 * 4.0 ms, 16 ahead 3.0 ms, 32 ahead 2.7 ms, 64 ahead 2.6 ms */
#define RS_AHEAD 32

RS_INLINE void prefetch_row(const Args *a, int64_t r, const int64_t d) {
    __builtin_prefetch(a->weight + r * d, 1, 1);
    if (a->kind == RS_ADAGRAD) __builtin_prefetch(a->state1 + r, 1, 1);
    if (a->kind == RS_ADAM) {
        __builtin_prefetch(a->state1 + r * d, 1, 1);
        __builtin_prefetch(a->state2 + r * d, 1, 1);
    }
}

RS_INLINE void segment(const Args *a, int64_t s, const int64_t d, Scratch *sc) {
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
        axpy(sc->acc + sc->slot[h] * d, a->grad + a->bag_of_id[lo + k] * a->grad_stride, w, d);
    }
    for (int64_t j = 0; j < u && j < RS_AHEAD; ++j) prefetch_row(a, sc->uniq[j], d);
    for (int64_t j = 0; j < u; ++j) {
        /* rows are read-modified-written: keep RS_AHEAD of them in flight */
        if (j + RS_AHEAD < u) prefetch_row(a, sc->uniq[j + RS_AHEAD], d);
        const int64_t r = sc->uniq[j];
        float *w = a->weight + r * d;
        const float *g = sc->acc + j * d;
        if (a->dirty) a->dirty[r] = 1; /* changed since the last checkpoint */
        if (a->kind == RS_SGD) {
            sub_scaled(w, g, a->lr, d);
        } else if (a->kind == RS_ADAGRAD) {
            a->state1[r] += sum_sq(g, d) / (float)d;
            sub_scaled(w, g, a->lr / (sqrtf(a->state1[r]) + a->eps), d);
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
}

RS_AVX2 static void segments(const Args *a, int64_t s0, int64_t s1, int64_t d, Scratch *sc) {
    for (int64_t s = s0; s < s1; ++s) {
        switch (d) { /* constant d: the vector loops unroll */
        case 8: segment(a, s, 8, sc); break;
        case 16: segment(a, s, 16, sc); break;
        case 32: segment(a, s, 32, sc); break;
        case 64: segment(a, s, 64, sc); break;
        case 128: segment(a, s, 128, sc); break;
        default: segment(a, s, d, sc); break;
        }
    }
}
#endif

/* 0 on success, -1 when unsupported here (no AVX2 build, d % 8 != 0, unknown kind), -2
 * when out of memory. */
int recscale_sparse_update(int64_t kind, float *weight, int64_t dim, float *state1, float *state2,
                           const int64_t *rows, const int64_t *seg_starts, int64_t s0, int64_t s1,
                           const int64_t *bag_of_id, const float *psw, const float *grad,
                           int64_t grad_stride, float lr, float eps, float beta1, float beta2,
                           float step_size, uint8_t *dirty) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (dim <= 0 || dim % 8 != 0 || kind < RS_SGD || kind > RS_ADAM) return -1;
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
    int rc = 0;
    if (!sc.keys || !sc.slot || !sc.uniq || !sc.acc) {
        rc = -2;
    } else {
        const Args a = {(int)kind, weight, state1, state2, rows, seg_starts, bag_of_id, psw, grad,
                        grad_stride, lr, eps, beta1, beta2, step_size, dirty};
        segments(&a, s0, s1, dim, &sc);
    }
    free(sc.keys);
    free(sc.slot);
    free(sc.uniq);
    free(sc.acc);
    return rc;
#else
    (void)kind, (void)weight, (void)dim, (void)state1, (void)state2, (void)rows, (void)seg_starts;
    (void)s0, (void)s1, (void)bag_of_id, (void)psw, (void)grad, (void)grad_stride, (void)lr;
    (void)eps, (void)beta1, (void)beta2, (void)step_size, (void)dirty;
    return -1;
#endif
}
