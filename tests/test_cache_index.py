"""The tier cache's index passes (``embedding/cache_index.py``, ``native/cache_index.c``)
against plain torch indexing."""

from __future__ import annotations

import pytest
import torch

from recscale import native


@pytest.mark.parametrize("native_pass", [True, False])
def test_cache_probe_and_touch_match_torch_indexing(monkeypatch, native_pass):
    """The tier cache's index passes (embedding/cache_index.py), native and fallback,
    against plain indexing: every cached row's slot, the uncached rows' indices in order;
    LFU adds, LRU sets, and no other slot changes."""
    from recscale.embedding import cache_index

    if not native_pass:
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip("native library not built")
    g = torch.Generator().manual_seed(3)
    slot_of_row = torch.full((100_000,), -1, dtype=torch.int32)
    cached = torch.randperm(100_000, generator=g)[:3000]
    slot_of_row[cached] = torch.randperm(5000, generator=g)[:3000].int()
    for n in (0, 1, 17, 4000):
        rows = torch.randperm(100_000, generator=g)[:n]
        slots, missing_at = cache_index.probe(slot_of_row, rows)
        assert slots.dtype == torch.int64 and torch.equal(slots, slot_of_row[rows].long())
        assert torch.equal(missing_at, torch.nonzero(slot_of_row[rows] < 0).squeeze(1))
    score = torch.rand(5000, generator=g, dtype=torch.float64)
    slots = torch.randperm(5000, generator=g)[:1200]
    for lru, value in ((False, 1.0), (True, 42.0)):
        want = score.clone()
        want[slots] = value if lru else want[slots] + value
        cache_index.touch(score, slots, lru, value)
        assert torch.equal(score, want)
    for bad in (-1, 100_000, 2**40):  # an id beyond the table: an error, never a read
        with pytest.raises(IndexError, match="out of bounds"):
            cache_index.probe(slot_of_row, torch.tensor([5, bad, 7]))
