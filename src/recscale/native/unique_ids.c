/*
 * The distinct ids of a batch and each id's index among them, by hashing:
 *
 *   ids     [n] int64 (any values)
 *   uniq    [n] int64 out: the distinct ids in order of first appearance, count returned
 *   inverse [n] int64 out: uniq[inverse[i]] == ids[i]
 *
 * The tier's prefetch thread dedupes every batch (26 features x 2048 ids a step for
 * config A) before it looks up slots; torch.unique sorts them (~2.3 ms for 53k ids on
 * one core), an open-addressing table twice the batch's size (it stays in L2) takes a
 * pass. Returns the count, or -1 when the table cannot be allocated.
 */
#include <stdint.h>
#include <stdlib.h>

#include "recscale_native.h"

int64_t recscale_unique_ids(const int64_t *ids, int64_t n, int64_t *uniq, int64_t *inverse) {
    if (n <= 0) return 0;
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    int64_t *slot = malloc((size_t)cap * sizeof(int64_t)); /* index into uniq, -1 = empty */
    if (!slot) return -1;
    for (int64_t s = 0; s < cap; s++) slot[s] = -1;
    const uint64_t mask = (uint64_t)cap - 1;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 17; /* Fibonacci hashing */
        for (;; h++) {
            int64_t *s = &slot[h & mask];
            if (*s < 0) { /* first time seen */
                *s = count;
                uniq[count] = id;
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
    return count;
}
