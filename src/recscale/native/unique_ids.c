/*
 * The distinct ids of a batch and each id's index among them, by hashing:
 *
 *   ids     [n] int64 (any values)
 *   uniq    [n] int64 out: the distinct ids in order of first appearance, count returned
 *   inverse [n] int64 out: uniq[inverse[i]] == ids[i]
 *
 * The tier's prefetch thread dedupes every batch (26 features x 2048 ids a step for
 * config A) before it looks up slots; torch.unique sorts them (~2.3 ms for 53k ids on
 * one core), an open-addressing table twice the batch's size (int32 entries: 512 KiB for
 * 53k ids, within L2) takes a pass. Returns the count, or -1 when the table cannot be
 * allocated (or n is 2^31 or more).
 *
 * recscale_unique_probe does the cache's probe (cache_index.c) in the same pass: each
 * distinct id's slot, slots[k] = slot_of_row[uniq[k]] (-1: not cached), and the indices
 * k of the distinct ids not cached, ascending, in missing; counts = {distinct, missing}.
 * Returns 0, -1 (no memory), or -2 - i where ids[i] is outside [0, num_rows) (nothing
 * is valid then). Splitting the pass over threads by the ids' hash class was measured
 * and dropped: each thread still walks every id, and the class test is a branch
 * mispredicted every other id (~0.6 ms a thread for 53k ids against 0.9 for the pass).
 *
 * What splits instead is the batch itself where its values allow it: a batch's ids are
 * feature-major and each table's rows a range of its own, so the ids fall into runs whose
 * values do not overlap. recscale_disjoint_cuts finds cuts between such runs near even
 * shares of the ids; each part is then deduped and probed on its own thread
 * (recscale_unique_probe_part, writing at its own offset), and recscale_unique_probe_join
 * closes the gaps. The result is the one-pass result exactly: the parts share no id, so
 * first appearances in part order are first appearances overall.
 */
#include <stdint.h>
#include <stdlib.h>

#include "recscale_native.h"

#define AHEAD 16
#define HASH_MUL 0x9E3779B97F4A7C15ull /* Fibonacci hashing */

static int64_t dedupe(const int64_t *ids, int64_t n, const int32_t *slot_of_row, int64_t num_rows,
                      int64_t *uniq, int64_t *inverse, int64_t *slots, int64_t *missing,
                      int64_t *nmissing) {
    if (n >= INT32_MAX) return -1;
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    int32_t *slot = malloc((size_t)cap * sizeof(int32_t)); /* index into uniq, -1 = empty */
    if (!slot) return -1;
    for (int64_t s = 0; s < cap; s++) slot[s] = -1;
    const uint64_t mask = (uint64_t)cap - 1;
    int64_t count = 0, k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        const uint64_t h64 = (uint64_t)id * HASH_MUL;
        if (slot_of_row) {
            if ((uint64_t)id >= (uint64_t)num_rows) {
                free(slot);
                return -2 - i;
            }
            if (i + AHEAD < n && (uint64_t)ids[i + AHEAD] < (uint64_t)num_rows)
                __builtin_prefetch(&slot_of_row[ids[i + AHEAD]], 0, 0);
        }
        for (uint64_t h = h64 >> 17;; h++) {
            int32_t *s = &slot[h & mask];
            if (*s < 0) { /* first time seen */
                *s = (int32_t)count;
                uniq[count] = id;
                if (slot_of_row) {
                    const int64_t c = slot_of_row[id];
                    slots[count] = c;
                    if (c < 0) missing[k++] = count;
                }
                inverse[i] = count++;
                break;
            }
            if (uniq[*s] == id) {
                inverse[i] = *s;
                break;
            }
        }
    }
    free(slot);
    if (nmissing) *nmissing = k;
    return count;
}

int64_t recscale_unique_ids(const int64_t *ids, int64_t n, int64_t *uniq, int64_t *inverse) {
    if (n <= 0) return 0;
    return dedupe(ids, n, NULL, 0, uniq, inverse, NULL, NULL, NULL);
}

int64_t recscale_unique_probe(const int64_t *ids, int64_t n, const int32_t *slot_of_row,
                              int64_t num_rows, int64_t *uniq, int64_t *inverse, int64_t *slots,
                              int64_t *missing, int64_t *counts) {
    return recscale_unique_probe_part(ids, 0, n, slot_of_row, num_rows, uniq, inverse, slots,
                                      missing, counts);
}

/*
 * Cuts c_1 < ... < c_{k-1} in (0, n), each one where every id before it is smaller than
 * every id from it on (so the parts [c_j, c_{j+1}) hold disjoint sets of values), the
 * valid cut nearest to each of j * n / parts; bounds = {0, c_1, ..., n}. Returns the
 * number of parts k (1 when no cut is valid, or on no memory for the suffix minima).
 */
int64_t recscale_disjoint_cuts(const int64_t *ids, int64_t n, int64_t parts, int64_t *bounds) {
    bounds[0] = 0, bounds[1] = n;
    if (parts < 2 || n < 2 * parts) return 1;
    int64_t *suffix_min = malloc((size_t)n * sizeof(int64_t));
    if (!suffix_min) return 1;
    suffix_min[n - 1] = ids[n - 1];
    for (int64_t i = n - 2; i >= 0; --i)
        suffix_min[i] = ids[i] < suffix_min[i + 1] ? ids[i] : suffix_min[i + 1];
    /* k: parts so far; t: the next target; last: the latest valid cut (0: none yet) */
    int64_t k = 1, t = 1, prefix_max = ids[0], last = 0;
    for (int64_t i = 1; i < n && t < parts; ++i) {
        if (prefix_max < suffix_min[i]) { /* a valid cut at i */
            for (; t < parts && i >= t * n / parts; ++t) { /* the nearer of last and i */
                const int64_t target = t * n / parts;
                const int64_t c = (last > 0 && target - last <= i - target) ? last : i;
                if (c > bounds[k - 1]) bounds[k++] = c;
            }
            last = i;
        }
        if (ids[i] > prefix_max) prefix_max = ids[i];
    }
    free(suffix_min);
    if (t < parts && last > bounds[k - 1]) bounds[k++] = last; /* targets past every cut */
    bounds[k] = n;
    return k;
}

/*
 * The one-pass recscale_unique_probe over ids[lo, hi) alone, its output placed at offset
 * lo: uniq/slots[lo + j] for its j-th distinct id, inverse[i] = lo + j, missing[lo + m] =
 * lo + j; counts[0..1] = {distinct, missing} of the part. Returns 0, -1 (no memory) or
 * -2 - i for an id ids[i] outside [0, num_rows).
 */
int64_t recscale_unique_probe_part(const int64_t *ids, int64_t lo, int64_t hi,
                                   const int32_t *slot_of_row, int64_t num_rows, int64_t *uniq,
                                   int64_t *inverse, int64_t *slots, int64_t *missing,
                                   int64_t *counts) {
    counts[0] = counts[1] = 0;
    if (hi <= lo) return 0;
    const int64_t count = dedupe(ids + lo, hi - lo, slot_of_row, num_rows, uniq + lo,
                                 inverse + lo, slots + lo, missing + lo, &counts[1]);
    if (count < -1) return count - lo; /* -2 - (i - lo) -> -2 - i */
    if (count < 0) return count;
    counts[0] = count;
    if (lo) { /* indices local to the part -> indices into the whole batch */
        for (int64_t i = lo; i < hi; ++i) inverse[i] += lo;
        for (int64_t m = 0; m < counts[1]; ++m) missing[lo + m] += lo;
    }
    return 0;
}

/*
 * Closes the gaps the parts of recscale_unique_probe_part left (parts bounds[p..p+1],
 * counts [parts][2]): the distinct ids, slots and missing indices of every part moved
 * down to follow the previous part's, inverse and missing renumbered. total = {distinct,
 * missing} of the whole batch.
 */
void recscale_unique_probe_join(const int64_t *bounds, int64_t parts, const int64_t *counts,
                                int64_t *uniq, int64_t *inverse, int64_t *slots,
                                int64_t *missing, int64_t *total) {
    int64_t u = counts[0], k = counts[1];
    for (int64_t p = 1; p < parts; ++p) {
        const int64_t lo = bounds[p], hi = bounds[p + 1], shift = lo - u;
        const int64_t cu = counts[2 * p], ck = counts[2 * p + 1];
        for (int64_t j = 0; j < cu; ++j) uniq[u + j] = uniq[lo + j], slots[u + j] = slots[lo + j];
        for (int64_t m = 0; m < ck; ++m) missing[k + m] = missing[lo + m] - shift;
        if (shift)
            for (int64_t i = lo; i < hi; ++i) inverse[i] -= shift;
        u += cu, k += ck;
    }
    total[0] = u, total[1] = k;
}
