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
 * recscale_cache_install: rows[i] now lives in slots[i] - slot_of_row[rows[i]] = slots[i],
 *   row_of_slot[slots[i]] = rows[i], dirty[slots[i]] = 0 (rows, slots distinct, in range).
 * recscale_cache_candidates: eviction's candidates among `slots` (ascending): those not
 *   blocked (a batch in flight holds them) and holding a row, into cand, their scores into
 *   cand_score; returns their count. One pass where torch took five (~8 ms for 520k).
 * recscale_cache_clear: the victims leave - slot_of_row[row_of_slot[v]] = -1,
 *   row_of_slot[v] = -1, score[v] = 0 (victims distinct, each holding a row).
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

void recscale_cache_install(int32_t *slot_of_row, int64_t *row_of_slot, uint8_t *dirty,
                            const int64_t *rows, const int64_t *slots, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(&slot_of_row[rows[i + AHEAD]], 1, 0);
            __builtin_prefetch(&row_of_slot[slots[i + AHEAD]], 1, 0);
        }
        slot_of_row[rows[i]] = (int32_t)slots[i];
        row_of_slot[slots[i]] = rows[i];
        dirty[slots[i]] = 0;
    }
}

int64_t recscale_cache_candidates(const int64_t *slots, int64_t n, const uint8_t *blocked,
                                  const int64_t *row_of_slot, const double *score, int64_t *cand,
                                  double *cand_score) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        if (blocked[s] || row_of_slot[s] < 0) continue;
        cand[k] = s;
        cand_score[k++] = score[s];
    }
    return k;
}

void recscale_cache_clear(int32_t *slot_of_row, int64_t *row_of_slot, double *score,
                          const int64_t *victims, int64_t n) {
    for (int64_t i = 0; i < n && i < 2 * AHEAD; i++)
        __builtin_prefetch(&row_of_slot[victims[i]], 1, 0);
    for (int64_t i = 0; i < n; i++) {
        if (i + 2 * AHEAD < n) __builtin_prefetch(&row_of_slot[victims[i + 2 * AHEAD]], 1, 0);
        if (i + AHEAD < n) __builtin_prefetch(&slot_of_row[row_of_slot[victims[i + AHEAD]]], 1, 0);
        const int64_t v = victims[i];
        slot_of_row[row_of_slot[v]] = -1;
        row_of_slot[v] = -1;
        score[v] = 0.0;
    }
}
