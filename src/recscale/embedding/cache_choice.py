"""Which rows a hot-row cache holds: the victims an eviction takes, and the list a warm
start fills it from. Pure functions over the cache's bookkeeping (CPU tensors and numpy
arrays), no storage state.

::

    score     [candidates] float64   a slot's LFU count or LRU time (lower: colder)
    position  [num_rows] int32/64    logical row -> file row; segment (start, n) holds
                                     its rows at file rows start + popularity rank
"""

from __future__ import annotations

import numpy as np
import torch


def lowest(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` smallest entries of a CPU ``score`` (ties: any), unordered.
    A selection, not a sort: numpy's introselect over 520k scores picks 162k in 1.2 ms
    where ``torch.topk`` took 19.5 ms (2 threads), most of the time an eviction spent
    choosing its victims."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if k >= score.numel():
        return torch.arange(score.numel())
    return torch.from_numpy(np.argpartition(score.numpy(), k - 1)[:k].astype(np.int64))


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
    # rank r of segment i at table[r, i]: read row by row, the rows come hottest first -
    # built in place, without sorting hundreds of millions of (rank, row) pairs (a warm
    # start beyond RAM spent ~5 GB on that, in the run's tightest moment for memory)
    depth = max(share.values(), default=0)
    table = np.full((depth, len(segments)), -1, np.int32 if len(position) < 2**31 else np.int64)
    for i, (start, n) in enumerate(segments):
        seg = position[start : start + n]  # file rows start + rank: the head is rank < share
        head = np.flatnonzero(seg < start + share[i])
        table[seg[head].astype(np.int64) - start, i] = start + head
    flat = table.ravel()
    if any(v < depth for v in share.values()):  # a short segment left holes
        flat = flat[flat >= 0]
    return flat.astype(np.int64)
