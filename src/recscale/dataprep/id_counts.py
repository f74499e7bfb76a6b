"""Per-feature id counts in an open-addressing hash table (numba), memory ~ distinct ids.

Keys are ``feature << 32 | raw value`` (int64, -1 = empty slot). Counting the
training split builds the vocabularies (``vocab`` mode) and the id-frequency
summaries of ``metadata.json``; after :meth:`IdCounts.assign_vocab` each slot also
holds its final id, and :meth:`IdCounts.map` turns raw values into ids in parallel.
"""

from __future__ import annotations

import numpy as np

from recscale.kernels import numba as nb

_EMPTY = -1
MISSING_ID, RARE_ID, FIRST_VOCAB_ID = 0, 1, 2


@nb.njit(cache=True, nogil=True)
def _slot(keys, key):
    mask = keys.shape[0] - 1
    h = (key * 0x5851F42D4C957F2D) >> 17  # odd constant < 2**63: stays int64 in numba
    h &= mask
    while keys[h] != _EMPTY and keys[h] != key:
        h = (h + 1) & mask
    return h


@nb.njit(cache=True, nogil=True)
def _count(keys, counts, cats, missing, size):
    rows, num_cat = cats.shape
    for r in range(rows):
        m = missing[r]
        for f in range(num_cat):
            if (m >> f) & 1:
                continue
            key = (np.int64(f) << 32) | np.int64(cats[r, f])
            h = _slot(keys, key)
            if keys[h] == _EMPTY:
                keys[h] = key
                size += 1
            counts[h] += 1
    return size


@nb.njit(cache=True, nogil=True)
def _rehash(old_keys, old_counts, old_ids, keys, counts, ids):
    for i in range(old_keys.shape[0]):
        k = old_keys[i]
        if k != _EMPTY:
            h = _slot(keys, k)
            keys[h] = k
            counts[h] = old_counts[i]
            ids[h] = old_ids[i]


@nb.njit(cache=True, nogil=True, parallel=True)
def _map(keys, ids, cats, missing, out):
    rows, num_cat = cats.shape
    for r in nb.prange(rows):
        m = missing[r]
        for f in range(num_cat):
            if (m >> f) & 1:
                out[r, f] = MISSING_ID
                continue
            key = (np.int64(f) << 32) | np.int64(cats[r, f])
            h = _slot(keys, key)
            out[r, f] = ids[h] if keys[h] == key else RARE_ID


class IdCounts:
    def __init__(self, num_features: int, capacity: int = 1 << 16) -> None:
        self.num_features = num_features
        self._alloc(capacity)
        self.size = 0
        self.missing = np.zeros(num_features, np.int64)  # each feature's missing values

    def _alloc(self, capacity: int) -> None:
        self.keys = np.full(capacity, _EMPTY, np.int64)
        self.counts = np.zeros(capacity, np.int64)
        self.ids = np.full(capacity, RARE_ID, np.int32)

    def _reserve(self, new_keys: int) -> None:
        need = self.size + new_keys
        cap = self.keys.shape[0]
        if need <= 0.7 * cap:
            return
        while need > 0.5 * cap:
            cap *= 2
        old = (self.keys, self.counts, self.ids)
        self._alloc(cap)
        _rehash(*old, self.keys, self.counts, self.ids)

    def add(self, cats: np.ndarray, missing: np.ndarray) -> None:
        """Count the present values of a block ``cats [rows, F] uint32`` / ``missing [rows]``
        (bit f: feature f missing), and each feature's missing ones."""
        self._reserve(cats.shape[0] * cats.shape[1])
        self.size = _count(self.keys, self.counts, cats, missing, self.size)
        bit = np.arange(self.num_features, dtype=np.uint32)
        self.missing += ((missing[:, None] >> bit) & 1).sum(0, dtype=np.int64)

    def feature(self, f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, raw values, counts) of feature f's distinct ids."""
        slots = np.nonzero((self.keys != _EMPTY) & ((self.keys >> 32) == f))[0]
        return slots, (self.keys[slots] & 0xFFFFFFFF).astype(np.uint32), self.counts[slots]

    def assign_vocab(self, min_count: int) -> list[int]:
        """Give ids ``2..`` (in raw-value order) to values seen >= min_count times.

        Returns each feature's cardinality: vocab + the missing (0) and rare (1) ids.
        """
        sizes = []
        self.ids[:] = RARE_ID
        for f in range(self.num_features):
            slots, values, counts = self.feature(f)
            keep = counts >= min_count
            slots, values = slots[keep], values[keep]
            order = np.argsort(values, kind="stable")
            self.ids[slots[order]] = np.arange(
                FIRST_VOCAB_ID, FIRST_VOCAB_ID + len(order), dtype=np.int32
            )
            sizes.append(FIRST_VOCAB_ID + len(order))
        return sizes

    def map(self, cats: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Raw values -> vocab ids ``int32 [rows, F]`` (missing 0, rare or unseen 1)."""
        out = np.empty(cats.shape, np.int32)
        _map(self.keys, self.ids, cats, missing, out)
        return out

    def table_counts(self, f: int, size: int, id_mode: str) -> tuple[np.ndarray, np.ndarray]:
        """Feature f's lookups by final id over what was counted: ``(ids, counts)``, the
        ids that occur (ascending, int64) and how often - its values' counts added at the
        ids they become (their vocab ids after :meth:`assign_vocab`, rare values at
        ``RARE_ID``; or ``value mod size``) and its missing values at ``MISSING_ID``."""
        slots, values, counts = self.feature(f)
        ids = self.ids[slots].astype(np.int64) if id_mode == "vocab" else values % np.int64(size)
        if self.missing[f]:
            ids = np.append(ids, MISSING_ID)
            counts = np.append(counts, self.missing[f])
        uniq, where = np.unique(ids, return_inverse=True)
        # float64 sums of whole numbers below 2^53 are exact
        return uniq, np.bincount(where, weights=counts).astype(np.int64)

    def summary(self, f: int) -> dict[str, float | int]:
        """How concentrated feature f's lookups are (for caches and the planner)."""
        _, _, counts = self.feature(f)
        if counts.size == 0:
            return {
                "distinct": 0,
                "lookups": 0,
                "top_1pct_share": 0.0,
                "top_10pct_share": 0.0,
                "singletons": 0,
            }
        c = np.sort(counts)[::-1]
        total = int(c.sum())
        top = lambda frac: float(c[: max(1, int(round(frac * c.size)))].sum() / total)  # noqa: E731
        return {
            "distinct": int(c.size),
            "lookups": total,
            "top_1pct_share": top(0.01),
            "top_10pct_share": top(0.10),
            "singletons": int((c == 1).sum()),
        }
