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


def _native_or_fallback(monkeypatch, native_pass: bool) -> None:
    if not native_pass:
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip("native library not built")


@pytest.mark.parametrize("native_pass", [True, False])
def test_unique_probe_dedupes_and_probes_like_unique_then_indexing(monkeypatch, native_pass):
    """One pass (native) or torch.unique + probe (fallback): the distinct ids (order of
    first appearance natively, any order otherwise), uniq[inverse] == ids, each distinct
    id's slot and the ascending indices of those not cached; ids outside the map refused."""
    from recscale.embedding import cache_index

    _native_or_fallback(monkeypatch, native_pass)
    g = torch.Generator().manual_seed(5)
    slot_of_row = torch.full((50_000,), -1, dtype=torch.int32)
    cached = torch.randperm(50_000, generator=g)[:2000]
    slot_of_row[cached] = torch.randperm(4000, generator=g)[:2000].int()
    hot = torch.cat([cached[:300], torch.randperm(50_000, generator=g)[:300]])
    for n in (0, 1, 9, 6000):  # 6000 ids drawn from 600: heavy repeats
        ids = hot[torch.randint(0, hot.numel(), (n,), generator=g)]
        uniq, inverse, slots, missing_at = cache_index.unique_probe(slot_of_row, ids)
        assert torch.equal(uniq[inverse], ids)
        assert torch.equal(torch.sort(uniq).values, torch.unique(ids))
        if native_pass and n:  # first appearance
            first = [ids.tolist().index(u) for u in uniq.tolist()]
            assert first == sorted(first)
        assert torch.equal(slots, slot_of_row[uniq].long())
        assert torch.equal(missing_at, torch.nonzero(slots < 0).squeeze(1))
    for bad in (-1, 50_000):
        with pytest.raises(IndexError, match="out of bounds"):
            cache_index.unique_probe(slot_of_row, torch.tensor([5, 5, bad, 7]))


def _one_pass(slot_of_row: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """recscale_unique_probe over all of ``ids`` on one thread: the reference."""
    lib, n = native.library(), ids.numel()
    out, counts = torch.empty(4, max(n, 1), dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    ptrs = [t.data_ptr() for t in out]
    assert (
        lib.recscale_unique_probe(
            ids.data_ptr(), n, slot_of_row.data_ptr(), slot_of_row.numel(), *ptrs, counts.data_ptr()
        )
        == 0
    )
    u, k = counts.tolist()
    return [out[0, :u], out[1, :n], out[2, :u], out[3, :k]]


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_unique_probe_in_parts_equals_the_one_pass(monkeypatch, threads):
    """A batch whose ids fall into runs of disjoint values (feature-major ids, a table a
    feature) is deduped in parts on several threads; the result must be the one pass's
    exactly - distinct ids in first-appearance order, inverse, slots, missing indices.
    Where no run is disjoint (features sharing one table, shuffled ids) it stays one pass.
    The cuts found are valid ones, and a bad id in a later part is still the first one
    named."""
    from recscale.embedding import cache_index

    lib = native.library()
    if lib is None:
        pytest.skip("native library not built")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(cache_index, "PARALLEL_MIN_IDS", 1)
    g = torch.Generator().manual_seed(11)
    features, batch, rows = 7, 3000, 20_000
    slot_of_row = torch.full((features * rows,), -1, dtype=torch.int32)
    cached = torch.randperm(features * rows, generator=g)[:30_000]
    slot_of_row[cached] = torch.arange(30_000, dtype=torch.int32)
    skewed = (torch.rand(features, batch, generator=g) ** 4 * rows).long()  # heavy repeats
    own = (skewed + torch.arange(features)[:, None] * rows).reshape(-1)
    shared = skewed.reshape(-1)  # every feature over one table: no disjoint runs
    for ids in (own, shared, own[torch.randperm(own.numel(), generator=g)], own[:5000]):
        bounds = torch.empty(threads + 1, dtype=torch.int64)
        parts = lib.recscale_disjoint_cuts(ids.data_ptr(), ids.numel(), threads, bounds.data_ptr())
        b = bounds[: parts + 1].tolist()
        assert b[0] == 0 and b[-1] == ids.numel() and b == sorted(set(b))
        for cut in b[1:-1]:  # every value before a cut is below every value after it
            assert int(ids[:cut].max()) < int(ids[cut:].min())
        if ids is own:
            assert parts == threads  # a cut near each target: the features' boundaries
        got = cache_index.unique_probe(slot_of_row, ids)
        for name, a, want in zip(
            ("uniq", "inverse", "slots", "missing"), got, _one_pass(slot_of_row, ids)
        ):
            assert torch.equal(a, want), name
    bad = own.clone()
    bad[-10], bad[-3] = features * rows + 5, -1  # both in the last part: the first named
    with pytest.raises(IndexError, match=f"row {features * rows + 5} is out of bounds"):
        cache_index.unique_probe(slot_of_row, bad)


@pytest.mark.parametrize("native_pass", [True, False])
def test_install_candidates_and_clear_keep_the_maps_inverse(monkeypatch, native_pass):
    """Install rows into free slots, pick eviction candidates (unblocked slots that hold a
    row, with their scores, in order), clear victims: against the same steps done by
    plain indexing, and the two maps stay each other's inverse."""
    from recscale.embedding import cache_index

    _native_or_fallback(monkeypatch, native_pass)
    g = torch.Generator().manual_seed(7)
    num_rows, c = 10_000, 600
    slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32)
    row_of_slot = torch.full((c,), -1, dtype=torch.int64)
    dirty = torch.ones(c, dtype=torch.bool)
    score = torch.rand(c, generator=g, dtype=torch.float64)
    rows = torch.randperm(num_rows, generator=g)[:400]
    slots = torch.randperm(c, generator=g)[:400]
    cache_index.install(slot_of_row, row_of_slot, dirty, rows, slots)
    assert torch.equal(row_of_slot[slots], rows) and torch.equal(slot_of_row[rows].long(), slots)
    assert int((slot_of_row >= 0).sum()) == 400 and int((row_of_slot >= 0).sum()) == 400
    assert not bool(dirty[slots].any()) and int(dirty.sum()) == c - 400

    look = torch.sort(torch.randperm(c, generator=g)[:450]).values
    blocked = torch.zeros(c, dtype=torch.bool)
    blocked[torch.randperm(c, generator=g)[:100]] = True
    cand, cand_score = cache_index.candidates(look, blocked, row_of_slot, score)
    want = look[~blocked[look] & (row_of_slot[look] >= 0)]
    assert torch.equal(cand, want) and torch.equal(cand_score, score[want])

    victims = cand[:50]
    gone = row_of_slot[victims].clone()
    cache_index.clear(slot_of_row, row_of_slot, score, victims)
    assert bool((slot_of_row[gone] == -1).all()) and bool((row_of_slot[victims] == -1).all())
    assert bool((score[victims] == 0).all())
    used = torch.nonzero(row_of_slot >= 0).squeeze(1)
    assert used.numel() == 350
    assert torch.equal(slot_of_row[row_of_slot[used]].long(), used)
    assert int((slot_of_row >= 0).sum()) == 350
