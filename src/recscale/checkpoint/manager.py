"""When to checkpoint, what kind, writing in the background, keeping the last K, and
finding the newest valid checkpoint to resume from.

Policy (``[checkpoint]``): save every ``every_steps`` steps and/or ``every_minutes``
minutes, and at the end. A checkpoint is *incremental* (only rows touched since the
previous checkpoint) unless it is every ``full_every``-th one, the first, or its
increment would exceed ``full_if_fraction`` of all rows - then it is *full*.

Asynchronous: ``capture`` copies the state to host memory (the training stall,
reported), then one background thread writes it; a save that comes while the
previous write is still running first waits for it (also counted as stall).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recscale.checkpoint.format import CheckpointError, read_manifest, recover, verify
from recscale.checkpoint.state import capture, write
from recscale.config.schema import CheckpointConfig
from recscale.models.dlrm import DLRM

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
    while manifest["kind"] == "incremental":
        parent = path.parent / manifest["parent"]
        if not parent.exists():
            raise CheckpointError(f"{chain[-1]}: its parent {parent} is missing")
        chain.append(parent)
        manifest = read_manifest(parent)
    return chain[::-1]


def resolve_chain(path: Path, echo: Callable[[str], None] = print) -> list[Path]:
    """``path`` is a checkpoint or a run directory / checkpoints folder: return the chain of
    the newest checkpoint whose whole chain verifies, saying which ones were skipped."""
    path = Path(path)
    if (path / "manifest.json").exists() or _NAME.match(path.name):
        chain = chain_of(path)
        for p in chain:
            verify(p)
        return chain
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
            return chain
        except CheckpointError as e:
            echo(f"recscale: skipping checkpoint {cand.name}: {e}")
    raise CheckpointError(
        f"no valid checkpoint in {root} (all {len(candidates)} failed verification)"
    )


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


class LocalTables:
    """Where the manager finds the tables: here, the single-process model (the sharded
    twin is ``recscale.distributed.checkpoint.ShardedTables``)."""

    is_writer = True

    def __init__(self, model: DLRM) -> None:
        self.model = model

    def storages(self) -> list:
        return [g.storage for g in self.model.embeddings.groups]

    def global_sum(self, x: int) -> int:
        return x

    def capture(self, dense_opt, trainer, kind, precision, parent, step):
        return capture(self.model, dense_opt, trainer, kind, precision, parent, step)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, root: Path, model: DLRM, dense_opt: torch.optim.Optimizer,
                 meta: dict[str, Any] | None = None, tables: Any = None) -> None:  # fmt: skip
        """``tables``: a :class:`LocalTables`-like source (default: ``model``'s own). With
        a sharded source every rank calls ``save``; only its writer (rank 0) writes."""
        self.cfg, self.root, self.model, self.dense_opt = cfg, root, model, dense_opt
        self.tables = tables if tables is not None else LocalTables(model)
        self.meta = meta or {}
        self.stats = CheckpointStats()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_time = time.monotonic()
        self._since_full = 0
        self._last_name: str | None = None
        self.enabled = cfg.every_steps > 0 or cfg.every_minutes > 0
        self._total_rows = sum(t.num_rows for t in model.embeddings.tables)
        for storage in self.tables.storages():
            storage.track_dirty(self.enabled)
        if not self.tables.is_writer:
            return
        if self.enabled:
            root.mkdir(parents=True, exist_ok=True)
        recover(root)
        for stale in root.glob(".step_*.tmp-*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)

    def resume_from(self, chain: list[Path]) -> None:
        """Continue the chain: the next checkpoint may be an increment of the restored one."""
        self._last_name = chain[-1].name
        self._since_full = len(chain) - 1

    def due(self, step: int) -> bool:
        c = self.cfg
        if c.every_steps and step % c.every_steps == 0:
            return True
        return bool(c.every_minutes and time.monotonic() - self._last_time >= 60 * c.every_minutes)

    def _kind(self) -> str:
        if self._last_name is None or self._since_full + 1 >= self.cfg.full_every:
            return "full"
        dirty = self.tables.global_sum(sum(int(s.dirty.sum()) for s in self.tables.storages()))
        return "full" if dirty > self.cfg.full_if_fraction * self._total_rows else "incremental"

    def save(self, step: int, trainer: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.wait()
        kind = self._kind()
        for storage in self.tables.storages():
            if hasattr(storage, "flush"):  # a cached tier: dirty rows back to the slow tier
                storage.flush()
        snap = self.tables.capture(self.dense_opt, trainer, kind, self.cfg.precision,
                                   self._last_name if kind == "incremental" else None, step)  # fmt: skip
        for storage in self.tables.storages():
            storage.dirty.zero_()
        name = f"step_{step:08d}" + (".inc" if kind == "incremental" else "")
        self._last_name, self._last_time = name, time.monotonic()
        self._since_full = 0 if kind == "full" else self._since_full + 1
        capture_s = time.perf_counter() - t0
        self.stats.stall_seconds += capture_s
        if snap is None:  # a sharded run's other ranks: rank 0 writes what they sent
            return
        snap.meta = self.meta

        def run() -> None:
            t = time.perf_counter()
            try:
                path = write(snap, self.root / name)
                on_disk = sum(f["bytes"] for f in read_manifest(path)["files"].values())
                self._prune()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
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

        if self.cfg.async_write:
            self._thread = threading.Thread(target=run, name="recscale-checkpoint", daemon=False)
            self._thread.start()
        else:  # the write itself stalls training too
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
            raise CheckpointError(f"writing a checkpoint failed: {err}") from err

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
