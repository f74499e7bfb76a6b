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
    counts[0] = counts[1] = 0;
    if (n <= 0) return 0;
    const int64_t count = dedupe(ids, n, slot_of_row, num_rows, uniq, inverse, slots, missing,
                                 &counts[1]);
    if (count < 0) return count;
    counts[0] = count;
    return 0;
}
