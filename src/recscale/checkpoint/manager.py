"""When to checkpoint, what kind, writing in the background, keeping the last K, and
finding the newest valid checkpoint to resume from.

Policy (``[checkpoint]``): save every ``every_steps`` steps and/or ``every_minutes``
minutes, and at the end. A checkpoint is *incremental* (only rows touched since the
previous checkpoint) unless it is every ``full_every``-th one, the first, or its
increment would exceed ``full_if_fraction`` of all rows - then it is *full*.

Asynchronous: ``capture`` copies the state to host memory (the training stall,
reported), then one background thread writes it; a save that comes while the
previous write is still running first waits for it (also counted as stall). Tables
on a host/ssd tier are streamed from their storage instead, synchronously - and so is
every table when ``async_write`` is off (the final save) or when the copy would take
more than ``COPY_SHARE`` of the host memory available (said once).

Every rank runs the same code (world size 1 included): each writes its own parts in
parallel, rank 0 adds the dense state and the manifest (``format.py``), and only
rank 0 prunes. Every rank must call ``save`` at the same steps.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recscale.checkpoint.format import (
    CheckpointError,
    CheckpointWriter,
    read_manifest,
    recover,
    verify,
)
from recscale.checkpoint.state import Checkpointable, capture, copy_bytes, write_part
from recscale.config.schema import CheckpointConfig
from recscale.distributed.context import DistContext
from recscale.procfs import mem_available
from recscale.units import size_text

# An asynchronous save copies the rows to host memory while training goes on; a copy
# above this share of the memory available is not made - the save streams the rows from
# the tables and training waits for the write (the copy's growth beside the step's own
# allocations had the kernel kill the run).
COPY_SHARE = 0.6

_NAME = re.compile(r"^step_(\d{8})(\.inc)?$")


def checkpoint_dirs(root: Path) -> list[Path]:
    """Completed-looking checkpoint directories (by name), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def chain_of(path: Path) -> list[Path]:
    """The full checkpoint and the increments leading to ``path``, in restore order."""
    chain = [path]
    manifest = read_manifest(path)
    while manifest.get("kind") == "incremental":
        parent = path.parent / str(manifest.get("parent"))
        if parent in chain:  # a damaged (or planted) manifest must not loop forever
            raise CheckpointError(f"{chain[-1]}: its chain of parents loops back to {parent.name}")
        if not parent.exists():
            raise CheckpointError(f"{chain[-1]}: its parent {parent} is missing")
        chain.append(parent)
        manifest = read_manifest(parent)
    return chain[::-1]


def valid_chains(path: Path, echo: Callable[[str], None] = print) -> Iterator[list[Path]]:
    """``path`` is a checkpoint or a run directory / checkpoints folder: the chains of its
    checkpoints whose every link verifies, newest first, saying which ones were skipped
    and why (one line each). A caller that finds a chain unusable takes the next."""
    path = Path(path)
    if (path / "manifest.json").exists() or _NAME.match(path.name):
        chain = chain_of(path)
        for p in chain:
            verify(p)
        yield chain
        return
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    recover(root)
    candidates = checkpoint_dirs(root)
    if not candidates:
        raise CheckpointError(f"no checkpoints in {root}")
    for cand in reversed(candidates):
        try:
            chain = chain_of(cand)
            for p in chain:
                verify(p)
        except CheckpointError as e:
            echo(f"recscale: skipping checkpoint {cand.name}: {e}")
            continue
        yield chain
    raise CheckpointError(f"no usable checkpoint in {root} (all {len(candidates)} were skipped)")


def resolve_chain(path: Path, echo: Callable[[str], None] = print) -> list[Path]:
    """The newest chain under ``path`` that verifies (see :func:`valid_chains`)."""
    return next(valid_chains(path, echo))


@dataclass
class CheckpointStats:
    saved: int = 0
    full: int = 0
    incremental: int = 0
    bytes: int = 0
    stall_seconds: float = 0.0
    write_seconds: float = 0.0
    last: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        model: Checkpointable,
        dense_opt: torch.optim.Optimizer,
        meta: dict[str, Any] | None = None,
        ctx: DistContext | None = None,
        timeout_s: float = 300.0,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        """``model.embeddings`` is any collection with ``local_parts()`` and ``storages()``
        (whole tables, or this rank's shards); ``ctx``: the ranks (default: one process).
        ``timeout_s``: how long rank 0 waits for the other ranks' parts. ``echo``: where
        a save that cannot copy its rows says so (once)."""
        self.cfg, self.root, self.model, self.dense_opt = cfg, root, model, dense_opt
        self.echo = echo
        self._said_streamed = False
        self.ctx = ctx if ctx is not None else DistContext()
        self.timeout_s = timeout_s
        self.meta = meta or {}
        self.stats = CheckpointStats()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_path: Path | None = None  # the checkpoint whose write failed
        self._last_time = time.monotonic()
        self._since_full = 0
        self._last_name: str | None = None
        self.enabled = cfg.every_steps > 0 or cfg.every_minutes > 0
        self._total_rows = sum(t.num_rows for t in model.embeddings.tables)
        for storage in model.embeddings.storages():
            storage.track_dirty(self.enabled)
        token = [f"{os.getpid()}-{time.time_ns()}"]
        if self.ctx.is_main:
            if self.enabled:
                root.mkdir(parents=True, exist_ok=True)
            recover(root)
            for stale in root.glob(".step_*.tmp-*"):  # left by a crash mid-write
                shutil.rmtree(stale, ignore_errors=True)
        # one token for the run's temp dirs, the same on every rank; stale ones gone first
        self._token = self.ctx.broadcast(token[0])

    def _global_sum(self, x: int) -> int:
        if not self.ctx.distributed:
            return x
        t = torch.tensor([x], dtype=torch.int64, device=self.ctx.device)  # NCCL: on the GPU
        dist.all_reduce(t, group=self.ctx.dense)
        return int(t[0])

    def resume_from(self, chain: list[Path]) -> None:
        """Continue the chain: the next checkpoint may be an increment of the restored one."""
        self._last_name = chain[-1].name
        self._since_full = len(chain) - 1

    def due_by_steps(self, step: int) -> bool:
        return bool(self.cfg.every_steps and step % self.cfg.every_steps == 0)

    def due_by_time(self) -> bool:
        """This rank's clock says so (on several ranks the step's all-reduce carries it
        to the others: ``train.parallel.reduce_step``)."""
        c = self.cfg
        return bool(c.every_minutes and time.monotonic() - self._last_time >= 60 * c.every_minutes)

    def _kind(self) -> str:
        if self._last_name is None or self._since_full + 1 >= self.cfg.full_every:
            return "full"
        storages = self.model.embeddings.storages()
        dirty = self._global_sum(sum(int(s.dirty.sum()) for s in storages if s.dirty is not None))
        return "full" if dirty > self.cfg.full_if_fraction * self._total_rows else "incremental"

    def _copy_fits(self, kind: str) -> bool:
        """Whether this save's copy of the rows fits beside training (``COPY_SHARE``)."""
        need, have = copy_bytes(self.model, kind, self.ctx.rank), mem_available()
        if need <= COPY_SHARE * have:
            return True
        if self.echo is not None and not self._said_streamed:
            self.echo(
                f"recscale: a checkpoint's copy of the tables ({size_text(need)}) would not fit "
                f"beside training ({size_text(have)} of host memory available): it is written "
                "from the tables while training waits"
            )
        self._said_streamed = True
        return False

    def save(self, step: int, trainer: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.wait()
        kind = self._kind()
        storages = self.model.embeddings.storages()
        for storage in storages:
            storage.flush()  # a cached tier: dirty rows back to the slow tier
        snap = capture(
            self.model,
            self.dense_opt,
            trainer,
            kind,
            self.cfg.precision,
            self._last_name if kind == "incremental" else None,
            step,
            self.ctx.rank,
            stream=not self.cfg.async_write or not self._copy_fits(kind),
        )
        for storage in storages:
            if storage.dirty is not None:  # a compressed table keeps none (written whole)
                storage.dirty.zero_()
        name = f"step_{step:08d}" + (".inc" if kind == "incremental" else "")
        self._last_name, self._last_time = name, time.monotonic()
        self._since_full = 0 if kind == "full" else self._since_full + 1
        capture_s = time.perf_counter() - t0
        self.stats.stall_seconds += capture_s
        manifest = {
            "kind": kind,
            "step": step,
            "parent": snap.parent,
            "precision": snap.precision,
            "table_order": snap.table_order,
            **self.meta,
        }
        is_main, world, token, rank = (
            self.ctx.is_main,
            self.ctx.world_size,
            self._token,
            self.ctx.rank,
        )

        def run() -> None:
            t = time.perf_counter()
            writer = None
            try:
                writer = CheckpointWriter(self.root / name, token, rank)
                write_part(snap, writer)
                if not is_main:
                    return
                path = writer.finalize(manifest, world, self.timeout_s)
                on_disk = sum(f["bytes"] for f in read_manifest(path)["files"].values())
                self._prune()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                if writer is not None:  # a full disk must not stay full of half a checkpoint
                    writer.abort()
                self._error, self._error_path = e, self.root / name
                return
            secs = time.perf_counter() - t
            self.stats.write_seconds += secs
            self.stats.saved += 1
            self.stats.bytes += on_disk
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)
            self.stats.last = name
            self.stats.history.append(
                {
                    "name": name,
                    "kind": kind,
                    "bytes": on_disk,
                    "capture_s": capture_s,
                    "write_s": secs,
                }
            )

        if self.cfg.async_write and not snap.streamed:
            self._thread = threading.Thread(target=run, name="recscale-checkpoint", daemon=False)
            self._thread.start()
        else:  # the write itself stalls training too (always, for streamed host/ssd tables)
            t = time.perf_counter()
            run()
            self.stats.stall_seconds += time.perf_counter() - t
            self._raise()

    def wait(self) -> None:
        """Block until the background write (if any) is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, KeyboardInterrupt | SystemExit):  # a second signal mid-write
                why = "interrupted by a second stop signal"
            else:
                why = str(err).strip() or type(err).__name__
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                why += f" ({size_text(shutil.disk_usage(self.root).free)} free there)"
            kept = [d.name for d in checkpoint_dirs(self.root)]
            raise CheckpointError(
                f"writing checkpoint {self._error_path} failed: {why}; "
                + (f"the newest good one, {kept[-1]}, is kept" if kept else "none is kept yet")
            ) from err

    def _prune(self) -> None:
        """Keep the newest ``keep`` checkpoints and every checkpoint their chains need."""
        dirs = checkpoint_dirs(self.root)
        keep = set()
        for d in dirs[-self.cfg.keep :]:
            try:
                keep.update(p.name for p in chain_of(d))
            except CheckpointError:
                keep.add(d.name)
        for d in dirs:
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
