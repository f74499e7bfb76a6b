"""The tier cache's per-batch index passes (``native/cache_index.c``,
``native/unique_ids.c``), with torch's indexing as the fallback where the native
library is not built::

    slot_of_row [rows] int32   the slot caching a row, -1 = on the file only
    row_of_slot [C] int64      the row a slot holds, -1 = free
    dirty       [C] bool       a slot's row changed since it was read
    score       [C] float64    a slot's LFU count or LRU clock

Each access lands at random in arrays of millions of entries; the native passes
prefetch ahead so the misses overlap, and a probe is one pass instead of three."""

from __future__ import annotations

import torch

from recscale import native

# Below this many ids a batch is deduped in one pass: a thread's start costs more.
PARALLEL_MIN_IDS = 8192


def probe(slot_of_row: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, missing_at)``: ``slots[i] = slot_of_row[rows[i]]`` as int64 (-1 = not
    cached) and the ascending indices ``i`` of the rows not cached. CPU tensors, ``rows``
    int64; a row outside ``slot_of_row`` is an ``IndexError``, as indexing would say."""
    lib = native.library()
    if lib is None or slot_of_row.dtype != torch.int32 or rows.dtype != torch.int64:
        bad = rows[(rows < 0) | (rows >= slot_of_row.numel())]  # torch would wrap a -1
        if bad.numel():
            _out_of_bounds(int(bad[0]), slot_of_row.numel())
        slots = slot_of_row[rows].long()
        return slots, torch.nonzero(slots < 0).squeeze(1)
    rows = rows.contiguous()
    n = rows.numel()
    slots = torch.empty(n, dtype=torch.int64)
    missing_at = torch.empty(n, dtype=torch.int64)
    k = lib.recscale_cache_probe(
        slot_of_row.data_ptr(),
        slot_of_row.numel(),
        rows.data_ptr(),
        n,
        slots.data_ptr(),
        missing_at.data_ptr(),
    )
    if k < 0:
        _out_of_bounds(int(rows[-1 - k]), slot_of_row.numel())
    return slots, missing_at[:k]


def unique_probe(
    slot_of_row: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uniq, inverse, slots, missing_at)``: a batch's distinct ``ids`` in order of first
    appearance natively (``uniq[inverse] == ids``), each one's slot (int64, -1 = not
    cached) and the ascending indices into ``uniq`` of those not cached - :func:`unique_ids`
    and :func:`probe` in one native pass. An id outside ``slot_of_row`` is an
    ``IndexError``.

    Where the ids fall into runs of disjoint values (a batch's features, each over a
    table's own rows), the runs are deduped on ``torch.get_num_threads()`` threads
    (``native/unique_ids.c``); the result is the one-pass result exactly."""
    lib = native.library()
    n = ids.numel()
    too_many = n >= 2**31 - 1  # the hash table holds int32 indices
    if lib is None or slot_of_row.dtype != torch.int32 or ids.dtype != torch.int64 or too_many:
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return (uniq, inverse, *probe(slot_of_row, uniq))
    ids = ids.contiguous()
    out = torch.empty(4, n, dtype=torch.int64)
    counts = torch.zeros(2, dtype=torch.int64)
    uniq, inverse, slots, missing_at = out
    ptrs = (uniq.data_ptr(), inverse.data_ptr(), slots.data_ptr(), missing_at.data_ptr())
    threads = torch.get_num_threads() if n >= PARALLEL_MIN_IDS else 1
    parts = 1
    if threads > 1:
        bounds = torch.empty(threads + 1, dtype=torch.int64)
        parts = lib.recscale_disjoint_cuts(ids.data_ptr(), n, threads, bounds.data_ptr())
    if parts == 1:
        rc = lib.recscale_unique_probe(
            ids.data_ptr(), n, slot_of_row.data_ptr(), slot_of_row.numel(), *ptrs, counts.data_ptr()
        )
    else:  # parts of the batch that share no id, each on a thread of its own
        part_counts = torch.zeros(parts, 2, dtype=torch.int64)
        b = bounds.tolist()

        def args(p: int, _lo: int, _hi: int) -> tuple:
            return (
                ids.data_ptr(),
                b[p],
                b[p + 1],
                slot_of_row.data_ptr(),
                slot_of_row.numel(),
                *ptrs,
                part_counts[p].data_ptr(),
            )

        rcs = native.parallel_call(lib, "recscale_unique_probe_part", parts, args, parts)
        bad = [r for r in rcs if r < -1]  # -2 - i: the first bad id has the largest
        rc = -1 if -1 in rcs else (max(bad) if bad else 0)
        if rc == 0:
            lib.recscale_unique_probe_join(
                bounds.data_ptr(), parts, part_counts.data_ptr(), *ptrs, counts.data_ptr()
            )
    if rc == -1:
        raise MemoryError("unique_probe: no memory for the hash table")
    if rc < 0:
        _out_of_bounds(int(ids.view(-1)[-2 - rc]), slot_of_row.numel())
    u, k = counts.tolist()
    return uniq[:u], inverse.view(ids.shape), slots[:u], missing_at[:k]


def install(
    slot_of_row: torch.Tensor,
    row_of_slot: torch.Tensor,
    dirty: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``rows`` now live in ``slots`` (distinct, in range, int64): both maps set, the
    slots clean."""
    lib = _native_for((slot_of_row, torch.int32), (row_of_slot, torch.int64), (dirty, torch.bool))
    if lib is None or rows.dtype != torch.int64 or slots.dtype != torch.int64:
        row_of_slot[slots] = rows
        slot_of_row[rows] = slots.to(slot_of_row.dtype)
        dirty[slots] = False
        return
    rows, slots = rows.contiguous(), slots.contiguous()
    lib.recscale_cache_install(
        slot_of_row.data_ptr(),
        row_of_slot.data_ptr(),
        dirty.data_ptr(),
        rows.data_ptr(),
        slots.data_ptr(),
        rows.numel(),
    )


def candidates(
    slots: torch.Tensor, blocked: torch.Tensor, row_of_slot: torch.Tensor, score: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eviction's candidates among ``slots`` (int64): those not ``blocked`` (bool ``[C]``)
    that hold a row, and their scores - in ``slots``' order."""
    lib = _native_for((blocked, torch.bool), (row_of_slot, torch.int64), (score, torch.float64))
    if lib is None or slots.dtype != torch.int64:
        cand = slots[~blocked[slots] & (row_of_slot[slots] >= 0)]
        return cand, score[cand]
    slots = slots.contiguous()
    cand = torch.empty_like(slots)
    cand_score = torch.empty(slots.numel(), dtype=torch.float64)
    k = lib.recscale_cache_candidates(
        slots.data_ptr(),
        slots.numel(),
        blocked.data_ptr(),
        row_of_slot.data_ptr(),
        score.data_ptr(),
        cand.data_ptr(),
        cand_score.data_ptr(),
    )
    return cand[:k], cand_score[:k]


def clear(
    slot_of_row: torch.Tensor, row_of_slot: torch.Tensor, score: torch.Tensor, victims: torch.Tensor
) -> None:
    """``victims`` (distinct int64 slots, each holding a row) leave the cache: their rows
    unmapped, the slots empty, their scores 0."""
    lib = _native_for(
        (slot_of_row, torch.int32), (row_of_slot, torch.int64), (score, torch.float64)
    )
    if lib is None or victims.dtype != torch.int64:
        slot_of_row[row_of_slot[victims]] = -1
        row_of_slot[victims] = -1
        score[victims] = 0
        return
    victims = victims.contiguous()
    lib.recscale_cache_clear(
        slot_of_row.data_ptr(),
        row_of_slot.data_ptr(),
        score.data_ptr(),
        victims.data_ptr(),
        victims.numel(),
    )


def _native_for(*typed: tuple[torch.Tensor, torch.dtype]):
    """The native library where it is built and the index arrays have the dtypes its
    passes take, else None (torch's indexing runs)."""
    lib = native.library()
    return lib if lib is not None and all(t.dtype == d for t, d in typed) else None


def _out_of_bounds(row: int, num_rows: int) -> None:
    raise IndexError(f"row {row} is out of bounds for a table of {num_rows:,} rows")


def touch(score: torch.Tensor, slots: torch.Tensor, lru: bool, value: float) -> None:
    """``score[slots] = value`` (LRU) or ``score[slots] += value`` (LFU), in place;
    ``slots`` distinct, int64, within ``score`` (a CPU float64 tensor)."""
    lib = native.library()
    if lib is None or score.dtype != torch.float64 or slots.dtype != torch.int64:
        if lru:
            score[slots] = value
        else:
            score.index_add_(0, slots, torch.full(slots.shape, value, dtype=score.dtype))
        return
    slots = slots.contiguous()
    lib.recscale_cache_touch(score.data_ptr(), slots.data_ptr(), slots.numel(), int(lru), value)
