"""The hot-row cache's popularity order and warm start (a part of
:class:`~recscale.embedding.cached_storage.CachedStorage`, kept apart for size).

The mixin works on the cache's own fields (``rows``, ``slot_of_row``, ``score``,
``pinned``, ``free``, ``_lock``...) and its ``_reserve`` / ``_fetch`` / ``_install``;
``CachedStorage``'s docstring draws them.
"""

from __future__ import annotations

import numpy as np
import torch

from recscale.embedding.cache_choice import warm_list
from recscale.embedding.row_file import RowFile
from recscale.embedding.slipstream import Slipstream


class CacheWarmStart:
    """Row order, initial rows, warm start and Slipstream's hot set of a cached tier."""

    def set_row_order(self, position: np.ndarray | None, segments: list[tuple[int, int]]) -> None:
        """The rows' popularity order: ``position`` (logical row -> rank place, each of
        the ``segments`` (start, rows) - one per table part - a permutation of its own
        range, its hottest rows first); before any row is written. The ssd tier lays
        its file out by it; both tiers warm and pin their caches from its head (the
        host tier keeps its rows in id order: memory has no pages to fill)."""
        if isinstance(self.rows, RowFile):
            self.rows.set_order(position)
        self._order = position
        self._segments = list(segments)

    def initialize_segment(self, start: int, weight: torch.Tensor) -> None:
        """Rows ``[start, start + len(weight))`` take ``weight`` and fresh optimizer
        state, written in file order a chunk at a time (a table's initial values in one
        pass, with one chunk of whole rows beside ``weight`` in memory)."""
        n = weight.shape[0]
        values = weight.float().cpu().numpy()

        def make_rows(rel: np.ndarray) -> np.ndarray:
            data = np.empty((len(rel), self.width), np.float32)
            data[:, : self.dim] = values[rel]
            for name, _shape, lo, hi in self._state_cols:
                data[:, lo:hi] = self.optimizer.init_value(name)
            return data

        with self._settled():
            if bool((self.slot_of_row[start : start + n] >= 0).any()):
                raise RuntimeError("initialize_segment: rows of the segment are cached")
            self.rows.write_segment(start, n, make_rows)

    def warm_rows(self) -> torch.Tensor:
        """The rows a warm start fills the cache with, hottest first: the head of each
        segment's file order, the cache shared equally among the segments (a segment
        smaller than its share gives the rest to the others). Empty without an order."""
        if self._order is None or not self._segments:
            return torch.zeros(0, dtype=torch.int64)
        return torch.from_numpy(warm_list(self._order, self._segments, self.cache_rows))

    def pin_limit(self, share: float, ids_per_table: int) -> int:
        """The warm rows to keep for the run: ``share`` of the cache, but never so many
        that two batches (the one stepping and the one prefetched) lack room - each brings
        at most ``ids_per_table`` distinct rows of each table part, or the part's rows.
        With pins leaving less, a small cache stopped the run at its first eviction. A
        cache holding every row never evicts: any share may stay."""
        c = self.cache_rows
        if c >= self.num_rows:
            return int(share * c)
        parts = self._segments or [(0, self.num_rows)]
        in_flight = 2 * sum(min(n, ids_per_table) for _start, n in parts)
        return max(0, min(int(share * c), c - in_flight))

    def warm(self, rows: torch.Tensor, pin: int = 0, chunk: int = 1 << 20) -> int:
        """Fill free cache slots with ``rows`` (hottest first) before training; the
        first ``pin`` stay resident for the run (:meth:`pin_limit`); the others' scores
        fall from 1 to 0 along the list, so
        any row a batch uses outranks them and the coldest go first. Returns the rows
        made resident."""
        with self._settled():
            rows = rows.cpu()
            # chunk by chunk, never a filtered copy of the whole list: count first
            k = sum(
                int((self.slot_of_row[rows[lo : lo + chunk]] < 0).sum())
                for lo in range(0, rows.numel(), chunk)
            )
            k = min(k, self.free.numel())
            done = 0
            for lo in range(0, rows.numel(), chunk):
                if done >= k:
                    break
                part = rows[lo : lo + chunk]
                part = part[self.slot_of_row[part] < 0][: k - done]
                order = torch.argsort(part)  # file order of an ordered file's head: sequential
                part = part[order]
                slots = self._reserve(part.numel(), torch.zeros(0, dtype=torch.int64))
                self._install(part, slots, self._fetch(part, slots))
                rank = (done + order).double()
                self.score[slots] = 1.0 - rank / max(k, 1)
                self.pinned[slots] = rank < pin
                done += part.numel()
            self._unpinned = None
            return k

    def enable_slipstream(self, threshold: float, interval: int, max_bytes: int = 64 << 20):
        """Skip stale hot rows' updates (``embedding/slipstream.py``): the pinned rows are
        the hot set, the hottest that fit ``max_bytes`` of snapshot watched."""
        with self._settled():
            hot = torch.nonzero(self.pinned).squeeze(1)
            keep = max(1, max_bytes // (4 * self.dim))
            if hot.numel() > keep:  # the hottest: highest warm-start score
                hot = hot[torch.argsort(self.score[hot], descending=True)[:keep]]
            self.slipstream = Slipstream(
                hot, self.cache_weight, self.cache_rows, threshold, interval
            )
