"""Which rows a hot-row cache holds: the victims an eviction takes, and the list a warm
start fills it from. Pure functions over the cache's bookkeeping (CPU tensors and numpy
arrays), no storage state.

::

    score     [candidates] float64   a slot's LFU count or LRU time (lower: colder)
    position  [num_rows] int32/64    logical row -> file row; segment (start, n) holds
                                     its rows at file rows start + popularity rank
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Above this many candidates ``lowest`` partitions around a sampled pivot first.
SAMPLED_SELECT_MIN = 1 << 16
SAMPLE = 4096


def lowest(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` smallest entries of a CPU ``score`` (ties: any), unordered.

    A selection, not a sort (``torch.topk`` took 19.5 ms for 162k of 520k scores on 2
    threads). numpy's introselect slows down on many equal values, which LFU scores
    are (most slots at one count: 17.9 ms for 162k of 520k such scores, 1.6 ms for
    distinct ones), so large inputs are first split three ways around a pivot drawn from
    a sample (below / equal / above: ties settle at once), and introselect finishes on
    what is left once it is small (``_smallest``)."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    n = score.numel()
    if k >= n:
        return torch.arange(n)
    rng = np.random.default_rng(n ^ k)
    return torch.from_numpy(_smallest(score.numpy(), k, rng).astype(np.int64, copy=False))


def _smallest(vals: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Positions of ``k`` smallest of ``vals`` (0 < k < len)."""
    m = vals.size
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= m:
        return np.arange(m)
    if m < SAMPLED_SELECT_MIN:
        return np.argpartition(vals, k - 1)[:k]
    if k > m // 2:  # keep all but the m - k largest: the smaller selection
        drop = _smallest(-vals, m - k, rng)
        keep = np.ones(m, dtype=bool)
        keep[drop] = False
        return np.flatnonzero(keep)
    sample = vals[rng.integers(0, m, SAMPLE)]
    # a pivot a few sampling deviations above the k-th: the k smallest then lie below it
    # (and equal to it) almost surely, and what lies below is little more than k
    share = k / m
    q = min(SAMPLE - 1, int(SAMPLE * share + 3 * math.sqrt(SAMPLE * share * (1 - share))) + 1)
    t = np.partition(sample, q)[q]
    below = np.flatnonzero(vals < t)
    if below.size > k:  # all k lie below the pivot
        return below[_smallest(vals[below], k, rng)]
    equal = np.flatnonzero(vals == t)
    if below.size + equal.size >= k:
        return np.concatenate([below, equal[: k - below.size]])
    above = np.flatnonzero(vals > t)
    rest = _smallest(vals[above], k - below.size - equal.size, rng)
    return np.concatenate([below, equal, above[rest]])


def warm_list(position: np.ndarray, segments: list[tuple[int, int]], cache_rows: int) -> np.ndarray:
    """The rows (int64) a warm start fills a cache of ``cache_rows`` with, hottest first:
    the head of each segment's order, the cache shared equally among the segments (a
    segment smaller than its share gives the rest to the others); among equal ranks the
    earlier segment first."""
    share, left = {}, cache_rows
    todo = sorted(range(len(segments)), key=lambda i: segments[i][1])
    for k, i in enumerate(todo):  # smallest first: each takes min(rows, equal share)
        share[i] = min(segments[i][1], left // (len(todo) - k))
        left -= share[i]
    # The list read rank by rank: rank r of every segment with more than r rows taken,
    # in segment order. Between two consecutive share sizes the same segments take
    # part, so that stretch of the list is a [ranks, segments] block, filled a segment
    # column at a time - no sort of hundreds of millions of (rank, row) pairs (a warm
    # start beyond RAM spent ~5 GB on that, in the run's tightest moment for memory),
    # and no padding where the tables' sizes differ.
    blocks, offset, lo = [], 0, 0
    for hi in sorted({v for v in share.values() if v > 0}):
        active = [i for i in range(len(segments)) if share[i] >= hi]
        blocks.append((lo, hi, {i: c for c, i in enumerate(active)}, offset))
        offset += (hi - lo) * len(active)
        lo = hi
    out = np.empty(offset, np.int64)
    for i, (start, n) in enumerate(segments):
        if share[i] == 0:
            continue
        seg = position[start : start + n]  # file rows start + rank: the head is rank < share
        head = np.flatnonzero(seg < start + share[i])
        ranked = np.empty(share[i], np.int64)  # the segment's head, hottest first
        ranked[seg[head].astype(np.int64) - start] = start + head
        for lo, hi, column, at in blocks:
            if hi > share[i]:
                break
            width = len(column)
            out[at : at + (hi - lo) * width].reshape(hi - lo, width)[:, column[i]] = ranked[lo:hi]
    return out
