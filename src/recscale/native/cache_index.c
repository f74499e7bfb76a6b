/*
 * The tier cache's per-batch index work (embedding/cached_storage.py), one pass each:
 *
 *   slot_of_row [rows] int32   the slot caching a row, -1 = on the file only
 *   score       [C] float64    a slot's LFU count or LRU clock
 *
 * recscale_cache_probe: slots[i] = slot_of_row[rows[i]] (int64), and the indices i of
 *   the rows not cached, ascending, in missing[0..k); returns k, or -1 - i where rows[i]
 *   is outside [0, num_rows) (nothing is read there).
 * recscale_cache_touch: score[slots[i]] += value (LFU) or = value (LRU); slots distinct
 *   and in [0, C).
 *
 * A batch's distinct rows land all over a table of tens of millions of rows (and a cache
 * of millions of slots): each access is a cache and TLB miss. torch's indexing takes
 * them one after another, and a probe was three passes (gather, mask, compress) - ~1.8
 * ms of the prefetch thread a step for config A beside training. Here the entry
 * AHEAD on is prefetched while this one is read, so the misses overlap.
 */
#include <stdint.h>

#include "recscale_native.h"

#define AHEAD 16

int64_t recscale_cache_probe(const int32_t *slot_of_row, int64_t num_rows, const int64_t *rows,
                             int64_t n, int64_t *slots, int64_t *missing) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && (uint64_t)rows[i + AHEAD] < (uint64_t)num_rows)
            __builtin_prefetch(&slot_of_row[rows[i + AHEAD]], 0, 0);
        if ((uint64_t)rows[i] >= (uint64_t)num_rows) return -1 - i;
        const int64_t s = slot_of_row[rows[i]];
        slots[i] = s;
        if (s < 0) missing[k++] = i;
    }
    return k;
}

void recscale_cache_touch(double *score, const int64_t *slots, int64_t n, int lru,
                          double value) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&score[slots[i + AHEAD]], 1, 0);
        if (lru)
            score[slots[i]] = value;
        else
            score[slots[i]] += value;
    }
}
