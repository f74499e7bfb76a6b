"""Rows on a slow tier behind a hot-row cache in fast memory: a file on SSD under a
host-memory cache (``ssd``), or host memory under a GPU-memory cache (``host``).

::

    file  [num_rows, D + S] fp32      every row, its optimizer state packed after it
                                      (one read brings a row with its state)
    cache weight [C, D], state [C, ...]  the resident rows, in slots
    slot_of_row [num_rows] int32      -1 = not resident;  row_of_slot [C]
    score [C]                         LFU: uses, halved every ``decay_every`` lookups;
                                      LRU: the lookup count at last use
    pinned [C] bool                   warm rows kept for the run (never evicted)

A training lookup makes its rows resident (a miss reads the row + state from the file; room
is made by evicting the lowest-score slots not used by the batch in flight, in
chunks of ``evict_fraction`` of the cache so the selection is amortised, writing
dirty victims back), then pools from the cache with slot indices. The backward
runs the same fused optimizer kernel as :class:`DeviceStorage` on the cache
tensors, with slots for rows: the cache changes where a row lives, never the
arithmetic - training equals all-in-memory training bit for bit (tests).
Evaluation lookups read missing rows straight from the file and admit nothing, so
scoring a large eval set neither needs nor disturbs the cache.

``prefetch(rows)`` makes the next batch's rows resident ahead of its lookup (the
prefetch pipeline calls it on a background thread); a lock serialises it with
lookups and updates, and the rows of every batch looked up but not yet updated
are pinned, so a prefetch never evicts a row whose gradient is still to come.

The file is scratch space for training, not a checkpoint: a crash leaves it as
it may be, and ``--resume`` rewrites every row from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recscale import native
from recscale.config.schema import CACHE_POLICIES as POLICIES
from recscale.embedding import cache_index, kernels
from recscale.embedding.cache_choice import lowest
from recscale.embedding.cache_stats import (
    CacheStats,
    CacheTooSmallError,
    Prefetched,
    UpdatePin,
)
from recscale.embedding.cache_warm import CacheWarmStart
from recscale.embedding.cached_prefetch import CachePrefetching
from recscale.embedding.cached_row_access import CachedRowAccess
from recscale.embedding.cpu_kernels import fused_update_cpu, unique_ids
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.row_file import (  # noqa: F401  (re-exported: the tier's errors)
    TEMP_DIR_PREFIX,
    HostRows,
    RowFile,
    TierFileError,
    remove_empty_temp_dirs,
)
from recscale.embedding.row_io import row_move
from recscale.embedding.slipstream import Slipstream
from recscale.embedding.storage import (
    RowStorage,
    merge_duplicate_rows,
    per_id_gradients,
    pool_rows,
)


class CachedStorage(CachePrefetching, CacheWarmStart, CachedRowAccess, RowStorage):
    def __init__(
        self,
        num_rows: int,
        dim: int,
        optimizer: SparseOptimizer,
        path: Path | None,
        cache_rows: int,
        policy: str = "lfu",
        kernel: str = "auto",
        decay_every: int = 1000,
        evict_fraction: float = 1 / 16,
        device: torch.device | None = None,
        io_depth: int = 32,
        io_access: str = "auto",
        high_halves: bool = False,
    ) -> None:
        """``path``: the ssd tier's file; ``None``: the host tier (rows in host memory,
        pinned when CUDA is present, behind a cache on ``device`` - a GPU run's tables
        larger than the GPU's memory). ``io_depth``: the file's requests in flight.
        ``high_halves``: ``row_precision=split_bf16`` - the lookup pools each value's bf16
        high half (the value truncated), what ``LowPrecisionStorage``'s split rows pool,
        while the rows, their updates and checkpoints stay exact fp32 (the split's two
        halves are that fp32 value's bits)."""
        super().__init__()
        self.high_halves = high_halves
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {policy!r}")
        if cache_rows < 1:
            raise ValueError("the cache needs at least one row")
        self.num_rows, self.dim, self.optimizer, self.kernel = num_rows, dim, optimizer, kernel
        self.policy, self.decay_every, self.evict_fraction = policy, decay_every, evict_fraction
        self.cache_rows = c = min(cache_rows, num_rows)
        self.state_names, self._state_cols = [], []
        col = dim
        for name, shape in optimizer.state_shapes(dim).items():
            width = int(math.prod(shape)) if shape else 1
            self.state_names.append(name)
            self._state_cols.append((name, shape, col, col + width))
            col += width
        self.width = col
        self.tier = "ssd" if path is not None else "host"
        # The slow tier: a file read and written in batches at depth, or a host array;
        # ``self.file`` is its array view (the file's memory map), in file-row order.
        if path is None:
            self.path = None
            pin = (
                torch.cuda.is_available()
                and device is not None
                and torch.device(device).type == "cuda"
            )
            self._host = torch.zeros(num_rows, col, pin_memory=pin)
            self.rows: RowFile | HostRows = HostRows(self._host.numpy())
        else:
            self.path = Path(path)
            self.rows = RowFile(self.path, num_rows, col, io_depth, io_access)
        for name, _shape, lo, hi in self._state_cols:  # a new (fallocated) file reads as zeros
            if optimizer.init_value(name) != 0.0:
                for r in range(0, num_rows, 1 << 18):
                    self.file[r : r + (1 << 18), lo:hi] = optimizer.init_value(name)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        # The cache lives on the compute device; all bookkeeping below stays on the CPU.
        self.cache_weight = torch.zeros(c, dim, device=device)
        self.cache_state = {
            name: torch.zeros((c, *shape), device=device)
            for name, shape, _lo, _hi in self._state_cols
        }
        self.slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32)
        self.row_of_slot = torch.full((c,), -1, dtype=torch.int64)
        self.score = torch.zeros(c, dtype=torch.float64)
        self.cache_dirty = torch.zeros(c, dtype=torch.bool)
        self.pinned = torch.zeros(c, dtype=torch.bool)
        self._unpinned: torch.Tensor | None = None  # eviction's candidates (see _evict)
        self._segments: list[tuple[int, int]] = []  # (start, rows) per table part
        self._order: np.ndarray | None = None  # popularity place of each row (set_row_order)
        self.free = torch.arange(c - 1, -1, -1)  # a stack: free slots, popped from the end
        self._prefetch_pins: list[Prefetched] = []  # prefetched batches not yet looked up
        self._prefetch_off = False  # set when the cache cannot hold two batches at once
        self._update_pins: list[UpdatePin] = []  # looked up for an update not yet applied
        self.dirty: torch.Tensor | None = None
        self.stats = CacheStats()
        self.slipstream: Slipstream | None = None  # off unless enable_slipstream
        self._clock = 0
        self._write_backs = 0  # generation: an unlocked read older than a write-back re-reads
        self._lock = threading.RLock()
        # Reads of prefetched batches still landing (``_complete`` on ``_reader``, one
        # thread, batches in order) while the prefetch thread plans the next batch.
        self._reader: ThreadPoolExecutor | None = None
        self._landing: list[Future] = []

    def homes(self):
        yield from super().homes()
        yield "cache_weight", self.cache_weight, True
        for name, t in self.cache_state.items():
            yield f"cache_state.{name}", t, True
        if self.slipstream is not None:
            yield from self.slipstream.homes()
        for name in ("slot_of_row", "row_of_slot", "score", "cache_dirty", "pinned", "free"):
            yield name, getattr(self, name), False
        if self.path is None:  # the host tier's rows (pinned when training on a GPU)
            yield "host_rows", self._host, False

    # -- the slow tier ------------------------------------------------------------------
    @property
    def file(self) -> np.ndarray:
        """The slow tier's rows in file-row order (the map, or the array ``RowFile.settle``
        loads)."""
        return self.rows.map

    def _direct_parts(self) -> list | None:
        """The cache's parts (tensor, first column in a file row) where rows move straight
        between the slow tier and the cache (``RowFile.move``: a CPU cache, the tier in
        memory, the native library); None where they go through a buffer."""
        if not self.rows.moves_rows:
            return None
        return self._cpu_parts()

    def _cpu_parts(self) -> list | None:
        """The cache's parts (tensor, first column in a row) where the native row copy can
        reach them (a CPU cache, the native library), else None."""
        if self.device.type != "cpu" or native.library() is None:
            return None
        return [(self.cache_weight, 0)] + [
            (self.cache_state[name], lo) for name, _shape, lo, _hi in self._state_cols
        ]

    def _fetch(self, rows: torch.Tensor, slots: torch.Tensor) -> np.ndarray | None:
        """Read ``rows`` for reserved ``slots``: straight into them (None returned) where
        the tier allows it, else into a buffer for ``_install`` to unpack."""
        parts = self._direct_parts()
        if parts is None:
            return self.rows.read(rows.numpy())
        self.rows.move(rows.numpy(), slots.numpy(), parts, to_table=False)
        return None

    def _pack(self, slots: torch.Tensor) -> np.ndarray:
        out = np.empty((slots.shape[0], self.width), np.float32)
        parts = self._cpu_parts()
        if parts is not None:  # one native pass (each slot's row a few cache misses)
            row_move(out, np.arange(len(out)), slots.numpy(), parts, True, split=False)
            return out
        idx = slots.to(self.device)
        out[:, : self.dim] = self.cache_weight[idx].cpu().numpy()
        for name, _shape, lo, hi in self._state_cols:
            out[:, lo:hi] = self.cache_state[name][idx].reshape(-1, hi - lo).cpu().numpy()
        return out

    def _unpack_into(self, slots: torch.Tensor, data: np.ndarray) -> None:
        parts = self._cpu_parts()
        if parts is not None:  # one native pass, not an index_put a part
            data = np.ascontiguousarray(data, dtype=np.float32)
            row_move(data, np.arange(len(data)), slots.numpy(), parts, False, split=False)
            return
        t = torch.from_numpy(np.ascontiguousarray(data)).to(self.device, non_blocking=True)
        idx = slots.to(self.device)
        self.cache_weight[idx] = t[:, : self.dim]
        for name, shape, lo, hi in self._state_cols:
            self.cache_state[name][idx] = t[:, lo:hi].reshape(-1, *shape)

    def _write_back(self, slots: torch.Tensor) -> None:
        slots = slots[self.cache_dirty[slots]]
        if slots.numel() == 0:
            return
        rows = self.row_of_slot[slots]
        parts = self._direct_parts()
        if parts is not None:
            self.rows.move(rows.numpy(), slots.numpy(), parts, to_table=True)
        else:
            order = torch.argsort(rows)  # sorted rows: sequential-ish file access
            slots, rows = slots[order], rows[order]
            self.rows.write(rows.numpy(), self._pack(slots))
        self._write_backs += 1
        self.cache_dirty[slots] = False
        self.stats.bytes_written += rows.numel() * self.width * 4

    def _evict(self, need: int, keep: torch.Tensor) -> None:
        """Free at least ``need`` slots, never one in ``keep`` or pinned. The candidates
        are the slots not pinned for the run (kept as an index: with 80% of a large
        cache pinned, scoring only the rest is 5x less work a time)."""
        c = self.cache_rows
        k = min(c, max(need, int(c * self.evict_fraction)))
        if self._unpinned is None:
            self._unpinned = torch.nonzero(~self.pinned).squeeze(1)
        blocked = torch.zeros(c, dtype=torch.bool)
        blocked[keep[keep >= 0]] = True  # a batch's probe: its misses are -1
        for p in [*(e.slots for e in self._prefetch_pins), *(u.slots for u in self._update_pins)]:
            blocked[p] = True
        cand, cand_score = cache_index.candidates(
            self._unpinned, blocked, self.row_of_slot, self.score
        )
        k = min(k, cand.numel())
        victims = cand[lowest(cand_score, k)]
        if victims.numel() < need:
            pinned = int((self.row_of_slot >= 0).sum()) - cand.numel()
            total = pinned + self.free.numel() + need  # all of it wanted resident at once
            held = int(self.pinned.sum())
            raise CacheTooSmallError(
                f"the embedding cache holds {c:,} rows, but the batches in flight need "
                f"{total:,} distinct rows resident at once ({pinned:,} already pinned"
                + (f", {held:,} of them warm rows kept for the run" if held else "")
                + "); raise embedding.cache_bytes"
                + (" or lower embedding.warm_pin_share" if held else "")
            )
        self._write_back(victims)
        cache_index.clear(self.slot_of_row, self.row_of_slot, self.score, victims)
        self.free = torch.cat([self.free, victims])
        self.stats.evictions += victims.numel()

    def _reserve(self, n: int, keep: torch.Tensor) -> torch.Tensor:
        """Take ``n`` free slots (evicting if needed, never a slot in ``keep``; -1s ignored)."""
        if n > self.free.numel():
            self._evict(n - self.free.numel(), keep)
        slots = self.free[self.free.numel() - n :]
        self.free = self.free[: self.free.numel() - n]
        return slots

    def _install(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        data: np.ndarray | None,
        checked: bool = False,
    ) -> bool:
        """Put rows read from the file into reserved slots (``data``: from ``_fetch``;
        None: already there). A row another thread brought in meanwhile keeps its slot
        (its copy may be newer); ours goes back to free. ``checked``: the lock was held
        since the rows were probed missing, so none can have been. Returns whether every
        row took the slot it was given."""
        all_fresh = True
        if not checked:
            fresh = self.slot_of_row[rows] < 0
            all_fresh = bool(fresh.all())
            if not all_fresh:
                self.free = torch.cat([self.free, slots[~fresh]])
                rows, slots = rows[fresh], slots[fresh]
                data = None if data is None else data[fresh.numpy()]
        if data is not None:
            self._unpack_into(slots, data)
        self.stats.bytes_read += rows.numel() * self.width * 4
        cache_index.install(self.slot_of_row, self.row_of_slot, self.cache_dirty, rows, slots)
        return all_fresh

    def _make_resident(
        self, uniq: torch.Tensor, probed: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, int]:
        """(slots of the distinct ``uniq``, how many were missing), fetching those; lock
        held. ``probed``: ``(slots, missing_at)`` of ``uniq``, probed under this lock hold."""
        slots, missing_at = probed or cache_index.probe(self.slot_of_row, uniq)
        if missing_at.numel():
            missing = uniq[missing_at]
            reserved = self._reserve(missing.numel(), slots)
            self._install(missing, reserved, self._fetch(missing, reserved), checked=True)
            slots[missing_at] = reserved
        return slots, missing_at.numel()

    def _touch(self, slots: torch.Tensor) -> None:
        """A batch used ``slots`` (distinct)."""
        self._clock += 1
        lru = self.policy == "lru"
        if not lru and self._clock % self.decay_every == 0:
            self.score.mul_(0.5)
        cache_index.touch(self.score, slots, lru, float(self._clock) if lru else 1.0)

    def io_stats(self) -> dict[str, float]:
        return self.rows.stats.as_dict()

    # -- RowStorage ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.cache_weight.device

    def native_slot_table(self) -> torch.Tensor | None:
        w = self.cache_weight
        if w.device.type != "cpu" or self.high_halves:  # the native pass pools whole values
            return None
        kernel = kernels.choose_once(self, self.kernel, "lookup", w, self.dim, 128)
        return w if kernel == "native" else None

    def slots_for_update(self, rows: torch.Tensor) -> torch.Tensor:
        return self._resident_for_update(rows.cpu())[0]

    def _resident_for_update(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's slot (CPU, then on the cache's device) with the batch's rows resident
        and pinned until its update: the prefetched entry where this batch is the oldest
        one prefetched, else brought in now."""
        entry = self._prefetch_pins[0] if self._prefetch_pins else None
        if entry is not None and entry.rows.shape == rows.shape and torch.equal(entry.rows, rows):
            if entry.landing is not None:  # its reads may still be in flight
                t = time.perf_counter()
                entry.landing.result()  # their error, if any, is raised here
                self.stats.read_wait_seconds += time.perf_counter() - t
            # The oldest prefetched batch is this one: resident, pinned, counted. No lock
            # (the prefetch thread may hold it for a while at its lower priority): its
            # slots join the update pins before they leave the prefetch pins (list ops are
            # atomic), so eviction never sees them unpinned, and the prefetch thread
            # writes only other slots' rows.
            self._update_pins.append(UpdatePin(rows, entry.slots, entry.slot_ids))
            self._prefetch_pins.pop(0)
            return entry.slot_ids, entry.device_slot_ids
        with self._settled():
            if self._prefetch_pins:  # prefetched, then not looked up
                self._prefetch_pins.pop(0)
            uniq, inverse, *probed = cache_index.unique_probe(self.slot_of_row, rows)
            slots, misses = self._make_resident(uniq, tuple(probed))
            self.stats.lookups += uniq.numel()
            self.stats.hits += uniq.numel() - misses
            self._touch(slots)
            slot_ids = slots[inverse]
            self._update_pins.append(UpdatePin(rows, slots, slot_ids))
            return slot_ids, slot_ids.to(self.device)

    def lookup(self, rows, offsets, per_sample_weights, for_update=False):
        dev = self.device
        rows = rows.cpu()
        if for_update:
            ids = self._resident_for_update(rows)[1]
            table = self.cache_weight
        else:  # evaluation: read misses straight from the file, admit nothing
            with self._settled():
                uniq, inverse = unique_ids(rows)
                table = torch.from_numpy(self._gather(uniq)[:, : self.dim].copy()).to(dev)
            ids = inverse.to(dev)
        if self.high_halves:  # split_bf16: the bf16 high halves, pooled in fp32
            w = table.index_select(0, ids)
            return pool_rows(
                (w.view(torch.int32) & -65536).view(torch.float32), offsets, per_sample_weights
            )
        return F.embedding_bag(
            ids,
            table,
            offsets,
            mode="sum",
            per_sample_weights=per_sample_weights,
            include_last_offset=True,
        )

    def track_dirty(self, enabled: bool) -> None:
        self.dirty = torch.zeros(self.num_rows, dtype=torch.bool) if enabled else None

    def cache_stats(self) -> CacheStats:
        return self.stats

    @torch.no_grad()
    def apply_pooled_gradients(self, rows, segments, bag_of_id, per_sample_weights, grad_pooled):
        kernel = kernels.choose_once(self, self.kernel, "backward", self.cache_weight, self.dim)
        # The batch's rows are pinned from its lookup to here (update pins): the fused CPU
        # kernel writes only their rows and dirty flags, so it needs no lock - as in
        # lookup, the prefetch thread may hold it a while at its lower priority.
        unlocked = self.slipstream is None and self._update_pins and kernel in ("native", "numba")
        with contextlib.nullcontext() if unlocked else self._lock:
            rows = rows.cpu()
            pin = self._update_pins[0] if self._update_pins else None
            if pin is not None and _same_tensor(pin.rows, rows):
                slots = pin.slot_ids  # pinned since the lookup: still where it put them
            else:
                slots = self.slot_of_row[rows].long()
                if bool((slots < 0).any()):
                    raise RuntimeError("a row was evicted between its lookup and its update")
            if self.slipstream is not None:
                rows, slots, segments, bag_of_id, per_sample_weights = self.slipstream.skip(
                    self.stats, rows, slots, segments, bag_of_id, per_sample_weights
                )
                if rows.numel() == 0:  # every id stale: the step counts, nothing moves
                    self.step.add_(1)
                    if self._update_pins:
                        self._update_pins.pop(0)
                    self.slipstream.after_update(int(self.step), self.cache_weight)
                    return
            if self.dirty is not None:
                self.dirty[rows] = True
            if kernel in ("native", "numba"):
                self.step.add_(1)
                fused_update_cpu(
                    self.optimizer,
                    self.cache_weight,
                    self.cache_state,
                    slots,
                    segments,
                    bag_of_id,
                    per_sample_weights,
                    grad_pooled,
                    int(self.step),
                    self.cache_dirty,
                    allow_native=kernel == "native",
                )
            elif kernel == "triton":  # the host tier's cache in GPU memory
                from recscale.embedding import triton_kernels

                self.step.add_(1)
                slots_dev = slots.to(self.device)
                triton_kernels.fused_update(
                    self.optimizer,
                    self.cache_weight,
                    self.cache_state,
                    slots_dev,
                    bag_of_id,
                    per_sample_weights,
                    grad_pooled,
                    int(self.step),
                )
                self.cache_dirty[slots] = True
            else:
                grad_ids = per_id_gradients(grad_pooled, bag_of_id, per_sample_weights)
                unique, summed = merge_duplicate_rows(slots.to(grad_ids.device), grad_ids)
                self.step.add_(1)
                self.optimizer.update_(
                    self.cache_weight, self.cache_state, unique, summed, int(self.step)
                )
                self.cache_dirty[unique.cpu()] = True
            if self._update_pins:  # batches are updated in lookup order
                self._update_pins.pop(0)
            if self.slipstream is not None:
                self.slipstream.after_update(int(self.step), self.cache_weight)

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        with self._lock:
            rows = rows.cpu()
            uniq = torch.unique(rows)
            slots, _ = self._make_resident(uniq)
            order = torch.searchsorted(uniq, rows)
            self.step.add_(1)
            self.optimizer.update_(
                self.cache_weight,
                self.cache_state,
                slots[order].to(self.device),
                grad,
                int(self.step),
            )
            self.cache_dirty[slots] = True
            if self.dirty is not None:
                self.dirty[rows] = True


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory, shape and strides (one tensor reached twice, e.g. saved for a
    backward): a pin holds ``a`` alive, so its memory cannot have been reused."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
