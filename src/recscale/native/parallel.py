"""Splitting a native kernel's work over Python threads (ctypes drops the GIL during
each call, so the threads run in parallel), with the caller's share learned per call site.

Why learned, not even: the pool's worker starts ~50-60 us after the caller hands it its
range (a sleeping thread on a VM has to be woken; measured at every native call of
config A's step), and the caller's range is not always as fast as the worker's (which
rows sit in whose cache). With even halves each call waited ~0.1 ms for the later
thread, ten calls a step. So each call site keeps the caller's fraction of the units, and
after every call moves it toward the split at which both threads would have finished
together, given the measured start delay and each thread's time per unit::

    units:   [0 ........ u0) caller    [u0 ..... n) worker(s), even among them
    aim:     u0 * t_caller  =  delay + (n - u0) / (P - 1) * t_worker
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] = (0, 0)
# (call site, n, parts) -> the caller's fraction of the units
_share: dict[tuple, float] = {}
ADAPTIVE = True  # False: every split even (tests; measuring what the learning gains)
_SMOOTH = 0.5  # how far one call moves the share toward its own best split
_LIMITS = (0.05, 0.95)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    key = (os.getpid(), workers)  # a forked child must not use the parent's threads
    if _pool is None or _pool_key != key:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recscale-native")
        _pool_key = key
    return _pool


def split(n: int, parts: int, share: float) -> list[int]:
    """Bounds of ``parts`` contiguous ranges of ``[0, n)``: the first about ``share * n``
    units (at least 1, leaving at least 1 to each other part), the rest even."""
    u0 = min(max(1, round(n * share)), n - (parts - 1))
    return [0] + [u0 + (n - u0) * i // (parts - 1) for i in range(parts)]


def parallel_parts(
    n: int,
    fn: Callable[[int, int, int], None],
    threads: int,
    key: object = None,
    adaptive: bool = True,
) -> None:
    """``fn(part, lo, hi)`` over up to ``threads`` contiguous ranges of ``[0, n)`` (part 0,
    the first range, runs on the caller's thread); ``fn`` should be a ctypes call. The
    split adapts per ``key`` (default: ``fn``'s code, i.e. where it was defined) and
    ``n`` (see the module docstring), unless ``adaptive`` is False: then it is even, a
    function of ``n`` and ``threads`` alone - for parts whose results are added up, so
    that the sums do not depend on timing (bitwise resume)."""
    parts = max(1, min(threads, n))
    if parts == 1:
        fn(0, 0, n)
        return
    site, bounds = plan(n, parts, key if key is not None else getattr(fn, "__code__", fn), adaptive)
    began = [0.0] * parts
    took = [0.0] * parts

    def work(p: int) -> None:
        began[p] = time.perf_counter()
        fn(p, bounds[p], bounds[p + 1])
        took[p] = time.perf_counter() - began[p]

    handed = time.perf_counter()
    futures: list[Future] = [_executor(parts - 1).submit(work, p) for p in range(1, parts)]
    try:
        work(0)
    finally:
        for f in futures:
            f.result()
    if site is not None:
        learn(site, n, bounds, handed, began, took)


def plan(n: int, parts: int, key: object, adaptive: bool) -> tuple[tuple | None, list[int]]:
    """The learning site (None: an even split, nothing to learn) and the part bounds of a
    call with ``parts`` >= 2 parts of ``n`` units."""
    if not (adaptive and ADAPTIVE):
        return None, split(n, parts, 1.0 / parts)
    site = (key, n, parts)
    return site, split(n, parts, _share.get(site, 1.0 / parts))


def parallel_for(n: int, fn: Callable[[int, int], None], threads: int) -> None:
    """``fn(lo, hi)`` over up to ``threads`` contiguous ranges of ``[0, n)``, the first on
    the caller's thread (:func:`parallel_parts` without the part index)."""
    parallel_parts(n, lambda _p, lo, hi: fn(lo, hi), threads, key=getattr(fn, "__code__", fn))


def learn(site: tuple, n: int, bounds: list[int], handed: float, began, took) -> None:
    """Move ``site``'s caller share toward the split at which the parts of this call
    (begun at ``began``, taking ``took`` seconds, handed out at ``handed``) would have
    finished together."""
    parts = len(bounds) - 1
    units = [bounds[p + 1] - bounds[p] for p in range(parts)]
    t_caller = took[0] / units[0]
    delay = sum(began[p] - handed for p in range(1, parts)) / (parts - 1)
    t_worker = sum(took[p] / units[p] for p in range(1, parts)) / (parts - 1)
    if t_caller <= 0.0 or t_worker <= 0.0:
        return
    per = t_worker / (parts - 1)  # a worker's time per unit of the n - u0 it shares
    best = (delay + n * per) / (t_caller + per) / n
    share = units[0] / n
    share += _SMOOTH * (min(max(best, _LIMITS[0]), _LIMITS[1]) - share)
    _share[site] = share
