"""Cache prefetch for a single-device ``EmbeddingBagCollection`` used directly (library
use and its tests; training and the benchmarks run the same prefetch inside
``distributed.pipeline``, after the input dist), and the cache statistics of any
collection.

While step t computes, a background thread takes batch t+1 and makes its rows
resident in the hot-row cache (reading misses from the file, evicting and writing
back cold rows), so the lookup at t+1 hits. The storage pins prefetched rows until
their lookup and looked-up rows until their update, so neither thread can evict a
row the other still needs, whatever ids consecutive batches share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from recscale.config.schema import EmbeddingConfig
from recscale.data.batch import Batch
from recscale.data.prefetch import Prefetcher
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection
from recscale.train.host_memory import release_free_memory
from recscale.units import size_text


class CachePrefetcher:
    def __init__(self, batches: Iterable[Batch], ebc: EmbeddingBagCollection, ahead: int = 1):
        self._batches, self._ebc, self._ahead = batches, ebc, ahead
        self.prefetch_seconds = 0.0

    def _run(self) -> Iterator[Batch]:
        for batch in self._batches:
            t = time.perf_counter()
            self._ebc.prefetch(batch.values, batch.offsets, batch.batch_size)
            self.prefetch_seconds += time.perf_counter() - t
            yield batch

    def __iter__(self) -> Iterator[Batch]:
        # depth 1: at most one prefetched batch waits (plus the one being prefetched), so
        # the pinned rows stay a small part of the cache.
        return iter(Prefetcher(self._run(), depth=self._ahead))

    def close(self) -> None:
        for s in self._ebc.storages():
            s.clear_prefetch()


def cached_storages(ebc) -> list:
    """The storages with a cache (host/ssd tiers) of a collection, sharded or not."""
    return [s for s in ebc.storages() if s.cache_stats() is not None]


def prefetch_on_thread(ebc, cfg: EmbeddingConfig, threads: int, cores: int) -> tuple[bool, str]:
    """Whether the cached tiers' prefetch runs on a background thread (the pipeline's)
    rather than inline in each lookup, and why (``embedding.cache_prefetch``).

    Inline, under ``auto``, where the prefetch is CPU work alone and no core is free for
    it: every cached tier keeps its cache and rows in this process's memory (an ssd file
    ``settle`` loaded, the host tier on the CPU) and the step's ``threads`` take all
    ``cores``. There a background thread takes a core from the step's OpenMP regions,
    which then wait for it (config A, 10% ssd cache, 2 vCPUs: forward + backward 23-25
    -> 28-30 ms a step, more than the ~5 ms of row work it took off the step). A tier that waits
    on a disk, or a GPU cache, keeps the thread: its waits overlap the step."""
    if cfg.cache_prefetch != "auto":
        return cfg.cache_prefetch == "thread", f"embedding.cache_prefetch={cfg.cache_prefetch}"
    storages = cached_storages(ebc)
    in_memory = all(st.device.type == "cpu" and st.rows.loaded for st in storages)
    if not in_memory:
        return True, "rows wait on the disk or a copy to the device: the thread overlaps them"
    if cores > threads:
        return True, f"{threads} compute threads leave {cores - threads} of {cores} cores free"
    return False, (
        f"rows in memory and the step's {threads} threads take all {cores} cores: a "
        "background thread would stall the step's parallel regions"
    )


def stall_guard(ebc, cfg: EmbeddingConfig, world_size: int) -> tuple[float, str]:
    """``(stall_seconds, stall_message)`` for the pipeline (``EmbeddingPipeline``): how long
    the step waits for a batch whose rows a tier is bringing in (``embedding.io_stall_seconds``)
    and what it waits on. Only where that is all it waits on - one process with a tier;
    with several ranks the wait holds their input all-to-all too, whose peers may be busy
    writing a checkpoint, and the process group's own timeout stands."""
    if world_size > 1 or not ebc.tiered():
        return 0.0, ""
    files = [str(st.path) for st in cached_storages(ebc) if getattr(st, "path", None)]
    what = ", ".join(files) or "host memory"
    return min(float(cfg.io_stall_seconds), threading.TIMEOUT_MAX), (
        f"its rows from {what} did not come (a stalled or far too slow device); the last "
        "checkpoint is as it was (embedding.io_stall_seconds waits longer, 0 for ever)"
    )


def prefetch_depth(ebc) -> int:
    """Batches the pipeline prepares ahead of the step: 2 where a cached tier's reads land
    on its reader thread (``CachedStorage.reads_land_later``: rows from a file the memory
    does not hold), so the next batch is planned - and its reads queued - while this
    one's are in flight and the disk never waits for the planning; else 1. Beyond RAM on
    a 2-vCPU VM: 43.9k samples/s at 1, 45.6k at 2 (docs/performance.md)."""
    return 2 if any(st.reads_land_later() for st in cached_storages(ebc)) else 1


def cache_report(ebc, prefetch_seconds: float, wait_seconds: float) -> dict | None:
    """Totals over the ssd-tier storages for ``metrics.json`` (None without any)."""
    storages = cached_storages(ebc)
    if not storages:
        return None
    total: dict[str, float] = {}
    for st in storages:
        for k, v in st.cache_stats().as_dict().items():
            total[k] = total.get(k, 0) + v
    total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 1.0
    total["cache_rows"] = sum(st.cache_rows for st in storages)
    total["table_rows"] = sum(st.num_rows for st in storages)
    total["prefetch_seconds"] = prefetch_seconds
    # the step waiting for its batch, or in a lookup for its batch's reads to land
    total["prefetch_stall_seconds"] = wait_seconds + total.get("read_wait_seconds", 0.0)
    return total


def hit_rate_since(ebc, last: tuple[int, int]) -> tuple[float, tuple[int, int]]:
    """Hit rate of the lookups since ``last`` (lookups, hits), and the new totals."""
    storages = cached_storages(ebc)
    lookups = sum(st.cache_stats().lookups for st in storages)
    hits = sum(st.cache_stats().hits for st in storages)
    d = lookups - last[0]
    return ((hits - last[1]) / d if d else 1.0), (lookups, hits)


def settle_files(ebc, echo) -> None:
    """Put the ssd tier's initial (or restored) rows on the disk before the first step,
    saying how long it took (``RowFile.settle``: a flush left to the kernel lands
    mid-run)."""
    files = [st.rows for st in cached_storages(ebc) if st.path is not None]
    if not files:
        return
    t = time.perf_counter()
    loaded = 0  # bytes loaded into memory: together they must fit, not each alone
    for f in files:
        loaded += f.settle(loaded)
    size = sum(f.num_rows * f.row_bytes for f in files)
    echo(
        f"recscale: ssd tier: {size_text(size)} of initial rows on the disk in "
        f"{time.perf_counter() - t:.1f} s (before step 0, not as a stall mid-run)"
        + (
            f"; {size_text(loaded)} of it loaded into memory for the run (the memory "
            "holds it: training reads and writes rows there, the file is not written mid-run)"
            if loaded
            else ""
        )
    )


def warm_caches(ebc, echo, cfg: EmbeddingConfig, ids_per_table: int) -> None:
    """Settles the ssd tier's files first (``settle_files``). With
    ``embedding.warm_start``: fill each ssd/host cache with its hottest rows (the head of
    its file order) before the first step - after any restore, so the rows read are the
    restored ones; the hottest ``embedding.warm_pin_share`` of each cache stay for the
    run, less where two batches of ``ids_per_table`` ids a table would lack room
    (``pin_limit``; ``planner.from_config.batch_ids_per_table``). Then the blocks
    initialization and the warm start freed go back to the system
    (``release_free_memory``)."""
    settle_files(ebc, echo)
    if cfg.warm_start:
        _warm(ebc, echo, cfg, ids_per_table)
    if cached_storages(ebc):  # the initialization's and warm start's freed blocks
        freed = release_free_memory()
        if freed >= 100 << 20:
            echo(
                f"recscale: {size_text(freed)} of memory freed by initialization given back "
                "before step 0"
            )


def _warm(ebc, echo, cfg: EmbeddingConfig, ids_per_table: int) -> None:
    t = time.perf_counter()
    rows = cached = pinned = 0
    for st in cached_storages(ebc):
        rows += st.warm(st.warm_rows(), pin=st.pin_limit(cfg.warm_pin_share, ids_per_table))
        cached += st.cache_rows
        pinned += int(st.pinned.sum())
    if rows:
        echo(
            f"recscale: cache warm start: {rows:,} of {cached:,} cache rows filled with the "
            f"hottest rows in {time.perf_counter() - t:.1f} s ({pinned:,} kept for the run: "
            "embedding.warm_pin_share)"
        )
    if cfg.slipstream:
        watched = 0
        for st in cached_storages(ebc):
            st.enable_slipstream(cfg.slipstream_threshold, cfg.slipstream_interval)
            watched += st.slipstream.hot.numel()
        echo(
            f"recscale: slipstream: {watched:,} hot rows watched; an update is skipped for "
            f"{cfg.slipstream_interval} steps where the row moved < "
            f"{cfg.slipstream_threshold:g} (relative) in the {cfg.slipstream_interval} before"
        )
