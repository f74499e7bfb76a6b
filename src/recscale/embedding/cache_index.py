"""The tier cache's per-batch index passes (``native/cache_index.c``), with torch's
indexing as the fallback where the native library is not built::

    slot_of_row [rows] int32   the slot caching a row, -1 = on the file only
    score       [C] float64    a slot's LFU count or LRU clock

Each access lands at random in arrays of millions of entries; the native passes
prefetch ahead so the misses overlap, and a probe is one pass instead of three."""

from __future__ import annotations

import torch

from recscale import native


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
