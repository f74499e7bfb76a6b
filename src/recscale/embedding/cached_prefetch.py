"""A cached tier's prefetch: a batch's rows made resident before its lookup, on the
pipeline's thread - a mixin of :class:`~recscale.embedding.cached_storage.CachedStorage`
(kept apart for size), working on its fields (``slot_of_row``, ``_lock``,
``_prefetch_pins``, ``_update_pins``...) and its ``_reserve`` / ``_fetch`` / ``_install``
/ ``_touch``; ``CachedStorage``'s docstring draws them.

Where the rows come from a file the memory does not hold, a prefetch is two stages on
two threads, so the disk never waits for the bookkeeping::

    pipeline thread   plan t+1 (probe, evict, slots)  plan t+2 ...
    reader thread                       read t+1's misses, score ..... read t+2's ...
    training thread   step t ............................ lookup t+1 (waits for its reads)

A planned batch's missing rows take their slots at once (the mapping before the data): a
later batch's probe finds them resident, and the batch's pin keeps all its slots from
eviction until its update. Anything else that reads or writes rows by id first waits
for every read in flight (``_settled``).
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from recscale.embedding import cache_index
from recscale.embedding.cache_stats import CacheTooSmallError, Prefetched
from recscale.embedding.cpu_kernels import unique_ids


class CachePrefetching:
    """``prefetch``, ``reads_land_later``, ``clear_prefetch`` and the wait for reads in
    flight (``_settled``)."""

    _reader: ThreadPoolExecutor | None  # set in CachedStorage.__init__
    _landing: list[Future]

    def prefetch(self, rows: torch.Tensor) -> None:
        """Make ``rows`` resident now (before their lookup) and pin them until updated.

        Does the lookup's bookkeeping too (unique ids, slots, scores), so the training
        thread's lookup of the same batch only pools; the file is read without holding
        the lock, so the training thread keeps running meanwhile. Where the rows come
        from the disk (``reads_land_later``) the reads land on the reader thread and
        this returns once they are issued: the caller plans the next batch while they
        are in flight, and the lookup waits for its own batch's."""
        if self._prefetch_off:
            return
        rows = rows.cpu()
        uniq, inverse = unique_ids(rows)  # first-appearance order: slots need no sort
        with self._lock:
            slots, missing_at = cache_index.probe(self.slot_of_row, uniq)
            missing = uniq[missing_at]
            try:
                reserved = self._reserve(missing.numel(), slots)
            except CacheTooSmallError as e:
                if not (self._prefetch_pins or self._update_pins):
                    raise  # one batch alone does not fit: nothing to give up but the run
                # The batch in flight and this one do not fit together: stop prefetching
                # (each lookup then brings its own rows in) rather than stop training.
                self._prefetch_off = True
                warnings.warn(
                    f"{e}; prefetching ahead is off for this table group (lookups now wait "
                    "for their misses)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            generation = self._write_backs
            self.stats.lookups += uniq.numel()
            self.stats.hits += uniq.numel() - missing.numel()
            self.stats.prefetched += missing.numel()
            if missing.numel() and self.reads_land_later():
                # The rows take their slots now, their data later: a later batch's probe
                # finds them resident (no second read of a row in flight), and the batch's
                # pin keeps every one of its slots from eviction until its update.
                cache_index.install(
                    self.slot_of_row, self.row_of_slot, self.cache_dirty, missing, reserved
                )
                slots[missing_at] = reserved
                entry = Prefetched(rows, slots, None, None)
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="recscale-reads")
                entry.landing = self._reader.submit(self._complete, entry, inverse, missing)
                while self._landing and self._landing[0].done():  # landed: forget them
                    self._landing.pop(0)
                self._landing.append(entry.landing)
                self._prefetch_pins.append(entry)
                return
        data = self._fetch(missing, reserved) if missing.numel() else None  # unlocked: slow
        with self._lock:
            if missing.numel():
                if self._write_backs != generation:  # a write-back may have raced our read
                    data = self._fetch(missing, reserved)
                if self._install(missing, reserved, data):
                    slots[missing_at] = reserved
                else:  # another thread installed some of them meanwhile
                    slots = self.slot_of_row[uniq].long()
            self._touch(slots)
            slot_ids = slots[inverse]
            device_ids = slot_ids.to(self.device, non_blocking=True)
            self._prefetch_pins.append(Prefetched(rows, slots, slot_ids, device_ids))

    def reads_land_later(self) -> bool:
        """Whether a prefetched batch's misses are read on the reader thread: rows from a
        file the memory does not hold (pread / direct), into a CPU cache."""
        return self.path is not None and not self.rows.moves_rows and self.device.type == "cpu"

    def _complete(self, entry: Prefetched, inverse: torch.Tensor, missing: torch.Tensor) -> None:
        """On the reader thread: read a prefetched batch's misses into the slots they took
        (theirs alone: pinned, not yet valid to anyone but this), then score the batch.
        No write-back can have raced the read: each missing row was on the file only when
        probed, and from then on held a pinned slot."""
        rows = missing.numpy()
        slots = self.slot_of_row[missing].long()
        data = self.rows.read(rows)
        self._unpack_into(slots, data)
        with self._lock:
            self.stats.bytes_read += rows.size * self.width * 4
            self._touch(entry.slots)
            slot_ids = entry.slots[inverse]
            entry.device_slot_ids = slot_ids.to(self.device, non_blocking=True)
            entry.slot_ids = slot_ids

    def _settle_reads(self) -> None:
        """Wait until every prefetched batch's reads have landed (before anything reads or
        writes rows by id, or drops prefetched batches). Never with the lock held: the
        reads take it to finish."""
        while self._landing:
            self._landing.pop(0).result()

    @contextlib.contextmanager
    def _settled(self):
        """The lock, taken once every prefetched batch's reads have landed (and none
        issued since: a batch planned between the wait and the lock is waited for too)."""
        while True:
            self._settle_reads()
            self._lock.acquire()
            if all(f.done() for f in self._landing):
                break
            self._lock.release()
        try:
            yield
        finally:
            self._lock.release()

    def clear_prefetch(self) -> None:
        """Forget prefetched batches that will not be looked up (the pipeline stopped)."""
        with self._settled():
            self._prefetch_pins.clear()
