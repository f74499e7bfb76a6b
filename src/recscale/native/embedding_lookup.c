/*
 * Table-batched sum-pooled embedding lookup with its id bookkeeping in one pass.
 *
 * The batch is feature-major jagged: bag j = f * B + b holds the ids
 * values[offsets[j] .. offsets[j + 1]) of feature f, sample b. Feature f's table is
 * the row block starting at row_offset[f] of weight [R, d] (row-major; fp32, fp16 or bf16
 * as `wt` says: row_format.h - pooling is in fp32 either way). For each
 * feature f in [f0, f1):
 *
 *     check 0 <= values[n] < table_size[f] for all its ids (else return n, the first bad
 *     index, having written nothing for this feature);
 *     rows[n] = values[n] + row_offset[f];  bag_of_id[n] = o = b * F + f;
 *     out[o] = sum_n weight[rows[n]] * psw[n]     (psw = 1 when NULL)
 *
 * (out_bf16: out is bf16, each sum rounded to nearest even as torch casts fp32 to bf16 -
 * a bf16 consumer's input at half the bytes; the sums themselves stay fp32)
 *
 * so out is sample-major [B, F, d]: what the dot interaction reads (a sample's vectors
 * contiguous) and, viewed as [B, F * d], what the MLP path takes -- no transpose copy.
 * bag_of_id indexes out's rows, so the gradient of out ([B * F, d]) goes to the fused
 * backward (sparse_update.c) as it is, together with rows. The rows of a
 * bag are prefetched, every line of them, a few ids ahead, so the random row reads overlap.
 *
 * Replaces, on the CPU, about ten torch ops (repeat_interleave, the id checks, the row
 * offsets) plus embedding_bag.
 *
 * weight == NULL: the checks, rows and bag_of_id only, nothing pooled (out unused) - a
 * cache's first pass: its slots are known only once the rows are (cached_storage.py);
 * the second pass pools with the slots for values, a zero row_offset and the cache's
 * size for every table_size.
 */
#include <stdint.h>

#include "recscale_native.h"
#include <string.h>

#include "row_format.h"

/* ids in flight: a row miss costs ~300 cycles and an id's own work ~15, so ~16 ahead
 * keeps the line fill buffers busy without evicting rows before their turn */
#define RS_PREFETCH_AHEAD 16

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RS_INLINE RS_AVX2 static inline __attribute__((always_inline))

/* Every 64-byte line of a row: a wide row's later lines would otherwise miss one after
 * another when the pooling reaches them (d = 128 fp32: 8 lines a row; config B's lookup
 * 3.6-4.5 -> 2.9-3.2 ms). The last byte too: a row whose size is not a multiple of 64
 * can end in one more line than its size spans. */
static inline __attribute__((always_inline)) void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 1);
    if (bytes % 64) __builtin_prefetch(row + bytes - 1, 0, 1);
}

RS_INLINE int64_t feature(const void *restrict weight, const int wt, const int64_t d,
                          const int64_t *restrict values, const int64_t *restrict offsets,
                          int64_t b, int64_t f, int64_t nf, int64_t row_offset, int64_t table_size,
                          const float *restrict psw, void *restrict out, const int out_bf16,
                          int64_t *restrict rows, int64_t *restrict bag_of_id) {
    const int64_t lo = offsets[f * b], hi = offsets[(f + 1) * b];
    const char *rows_at = (const char *)weight;
    const int64_t row_bytes = d * rs_value_bytes(wt);
    for (int64_t n = lo; n < hi; ++n)
        if (values[n] < 0 || values[n] >= table_size) return n;
    for (int64_t n = lo; n < hi && n < lo + RS_PREFETCH_AHEAD; ++n)
        prefetch_row(rows_at + (values[n] + row_offset) * row_bytes, row_bytes);
    for (int64_t j = f * b; j < (f + 1) * b; ++j) {
        const int64_t o = (j - f * b) * nf + f; /* sample j - f*b, feature f */
        __m256 acc[16]; /* d <= 128 */
        for (int64_t c = 0; c < d; c += 8) acc[c / 8] = _mm256_setzero_ps();
        for (int64_t n = offsets[j]; n < offsets[j + 1]; ++n) {
            if (n + RS_PREFETCH_AHEAD < hi)
                prefetch_row(rows_at + (values[n + RS_PREFETCH_AHEAD] + row_offset) * row_bytes,
                             row_bytes);
            const int64_t r = values[n] + row_offset;
            rows[n] = r;
            bag_of_id[n] = o;
            const void *w = rows_at + r * row_bytes;
            if (psw) {
                const __m256 s = _mm256_set1_ps(psw[n]);
                for (int64_t c = 0; c < d; c += 8)
                    acc[c / 8] = _mm256_fmadd_ps(rs_load8(w, c, wt), s, acc[c / 8]);
            } else {
                for (int64_t c = 0; c < d; c += 8)
                    acc[c / 8] = _mm256_add_ps(rs_load8(w, c, wt), acc[c / 8]);
            }
        }
        if (out_bf16)
            for (int64_t c = 0; c < d; c += 8)
                _mm_storeu_si128((__m128i *)((uint16_t *)out + o * d + c),
                                 rs_bf16_nearest8(acc[c / 8]));
        else
            for (int64_t c = 0; c < d; c += 8)
                _mm256_storeu_ps((float *)out + o * d + c, acc[c / 8]);
    }
    return -1;
}

/* Features [f0, f1); the switches make d and the row format constants so the vector
 * loops unroll and the accumulators stay in registers. */
RS_INLINE int64_t features_of(const void *weight, const int wt, int64_t d,
                                   const int64_t *values,
                                const int64_t *offsets, int64_t b, int64_t nf, int64_t f0,
                                int64_t f1, const int64_t *row_offset, const int64_t *table_size,
                                const float *psw, void *out, const int out_bf16, int64_t *rows,
                                int64_t *bag_of_id) {
#define RS_FEATURE(D) \
    feature(weight, wt, D, values, offsets, b, f, nf, row_offset[f], table_size[f], psw, out, \
            out_bf16, rows, bag_of_id)
    for (int64_t f = f0; f < f1; ++f) {
        int64_t bad;
        switch (d) {
        case 8: bad = RS_FEATURE(8); break;
        case 16: bad = RS_FEATURE(16); break;
        case 32: bad = RS_FEATURE(32); break;
        case 64: bad = RS_FEATURE(64); break;
        case 128: bad = RS_FEATURE(128); break;
        default: bad = RS_FEATURE(d); break;
        }
        if (bad >= 0) return bad;
    }
#undef RS_FEATURE
    return -1;
}

RS_AVX2 static int64_t features(const void *weight, int64_t wt, int64_t d, const int64_t *values,
                                const int64_t *offsets, int64_t b, int64_t nf, int64_t f0,
                                int64_t f1, const int64_t *row_offset, const int64_t *table_size,
                                const float *psw, void *out, int out_bf16, int64_t *rows,
                                int64_t *bag_of_id) {
#define RS_FORMAT(WT) \
    features_of(weight, WT, d, values, offsets, b, nf, f0, f1, row_offset, table_size, psw, out, \
                out_bf16, rows, bag_of_id)
    switch (wt) {
    case RS_F16: return RS_FORMAT(RS_F16);
    case RS_BF16: return RS_FORMAT(RS_BF16);
    default: return RS_FORMAT(RS_F32);
    }
#undef RS_FORMAT
}
#endif

/* weight == NULL: features [f0, f1)'s checks, rows and bag_of_id (see the top) */
static int64_t ids_only(const int64_t *values, const int64_t *offsets, int64_t b, int64_t nf,
                        int64_t f0, int64_t f1, const int64_t *row_offset,
                        const int64_t *table_size, int64_t *rows, int64_t *bag_of_id) {
    for (int64_t f = f0; f < f1; ++f) {
        const int64_t lo = offsets[f * b], hi = offsets[(f + 1) * b];
        for (int64_t n = lo; n < hi; ++n)
            if (values[n] < 0 || values[n] >= table_size[f]) return n;
        for (int64_t j = f * b; j < (f + 1) * b; ++j) {
            const int64_t o = (j - f * b) * nf + f;
            for (int64_t n = offsets[j]; n < offsets[j + 1]; ++n) {
                rows[n] = values[n] + row_offset[f];
                bag_of_id[n] = o;
            }
        }
    }
    return -1;
}

/* -1 on success; n >= 0: values[n] is outside its table (features before it are done);
 * -2: unsupported here (no AVX2 build, d not a multiple of 8 in 8 .. 128, unknown wt). */
int64_t recscale_pooled_lookup(const void *weight, int64_t dim, const int64_t *values,
                               const int64_t *offsets, int64_t batch_size, int64_t num_features,
                               int64_t f0, int64_t f1,
                               const int64_t *row_offset, const int64_t *table_size,
                               const float *psw, void *out, int64_t *rows, int64_t *bag_of_id,
                               int64_t wt, int64_t out_bf16) {
    if (!weight)
        return ids_only(values, offsets, batch_size, num_features, f0, f1, row_offset, table_size,
                        rows, bag_of_id);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (dim <= 0 || dim % 8 != 0 || dim > 128 || wt < RS_F32 || wt > RS_BF16) return -2;
    return features(weight, wt, dim, values, offsets, batch_size, num_features, f0, f1, row_offset,
                    table_size, psw, out, out_bf16 != 0, rows, bag_of_id);
#else
    (void)weight, (void)dim, (void)values, (void)offsets, (void)batch_size, (void)num_features;
    (void)f0, (void)f1;
    (void)row_offset, (void)table_size, (void)psw, (void)out, (void)rows, (void)bag_of_id;
    (void)wt, (void)out_bf16;
    return -2;
#endif
}
