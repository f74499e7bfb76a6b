"""On-disk format: one directory per checkpoint, a manifest written last, atomic rename.

::

    checkpoints/step_00000100/              full checkpoint
        manifest.json                       kind, step, parent, precision, world size, tables
                                            (each with its parts), files {name: {bytes, crc32}}
        trainer.json                        step, loader position, RNG state, config, plan
        dense.pt                            MLP weights + dense optimizer state (torch.save)
        parts/rank00001/C1.r0-500.c0-16.weight.f32     rows [0, 500) x cols [0, 16) of C1
        parts/rank00001/C1.r0-500.c0-16.state_sum.f32  their optimizer state
        ...                                 (.f16, or .q8 + .qparams.f32 for quantized rows)
    checkpoints/step_00000150.inc/          incremental: only rows touched since the previous one
        parts/rank00000/C1.r0-500.c0-16.rows.i64       which rows (table row ids) follow
        ...

Every rank writes the parts it holds (its shards; rank 0 also the replicated tables)
into the same temporary directory, in parallel, and then a small
``parts/rankNNNNN.json`` with its files' sizes and CRCs; rank 0 waits for all of
them, writes the manifest and renames. Nothing passes through rank 0's memory but
its own parts (the directory must be on a filesystem every rank sees, as for any
multi-node checkpoint). Parts are rectangles of a table in table coordinates, so a
checkpoint loads under any world size and plan: each rank reads the overlap of every
part with what it holds. (Version 1 checkpoints, one whole part per table under
``tables/``, load the same way.)

A checkpoint is written under ``.NAME.tmp-TOKEN`` (one token per run, the same on
every rank): every file is fsynced, the manifest (with a CRC32 and size per file) is
written and fsynced last, then the directory is renamed to its final name and the
parent directory fsynced. A crash at any moment leaves the previous checkpoints
untouched; a damaged checkpoint fails :func:`verify`, which names the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """One rank's writer into a checkpoint's temporary directory (see the module doc)."""

    def __init__(self, final_dir: Path, token: str, rank: int = 0) -> None:
        self.final_dir, self.rank = final_dir, rank
        self.tmp = final_dir.parent / f".{final_dir.name}.tmp-{token}"
        (self.tmp / "parts").mkdir(parents=True, exist_ok=True)
        self.files: dict[str, dict[str, int]] = {}

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        self.write_chunks(name, [data])

    def write_array(self, name: str, array: np.ndarray) -> None:
        self.write_bytes(name, memoryview(np.ascontiguousarray(array)).cast("B"))

    def write_chunks(self, name: str, chunks: Iterable[bytes | memoryview | np.ndarray]) -> None:
        """A file from a stream of pieces (a table too large to hold in memory at once)."""
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        size, crc = 0, 0
        with open(path, "wb") as f:
            for chunk in chunks:
                if isinstance(chunk, np.ndarray):
                    chunk = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(chunk)
                size += len(chunk)
                crc = zlib.crc32(chunk, crc)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"bytes": size, "crc32": crc}

    def commit_part(self, tables: list[dict[str, Any]]) -> None:
        """This rank is done: its files' sizes and CRCs and its table parts, for rank 0."""
        data = json.dumps({"files": self.files, "tables": tables}).encode()
        part = self.tmp / "parts" / f"rank{self.rank:05d}.json"
        with open(part.with_suffix(".json.tmp"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part.with_suffix(".json.tmp"), part)

    def finalize(self, manifest: dict[str, Any], world_size: int, timeout_s: float) -> Path:
        """Rank 0: wait for every rank's part, write the manifest, rename into place."""
        deadline = time.monotonic() + timeout_s
        parts = []
        for r in range(world_size):
            path = self.tmp / "parts" / f"rank{r:05d}.json"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{self.final_dir.name}: rank {r} did not write its part within "
                        f"{timeout_s:.0f}s (the previous checkpoint stays the newest)"
                    )
                time.sleep(0.01)
            parts.append(json.loads(path.read_text()))
        files: dict[str, dict[str, int]] = {}
        by_name: dict[str, dict[str, Any]] = {}
        for p in parts:
            files.update(p["files"])
            for t in p["tables"]:
                entry = by_name.setdefault(t["name"], {**t["table"], "stored_rows": 0, "parts": []})
                entry["parts"].append(t["part"])
                entry["stored_rows"] += t["part"]["stored_rows"]
        tables = [by_name[t] for t in manifest.pop("table_order") if t in by_name]
        manifest = {
            **manifest,
            "tables": tables,
            "world_size": world_size,
            "format_version": FORMAT_VERSION,
            "files": files,
        }
        data = json.dumps(manifest, indent=1).encode()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        for d in {(self.tmp / n).parent for n in files}:
            _fsync_dir(d)
        _fsync_dir(self.tmp / "parts")
        _fsync_dir(self.tmp)
        # Replacing a checkpoint of the same step (a run restarted from an earlier one):
        # move the old one aside first, never delete it before the new one is in place;
        # recover() puts it back if a crash hits between the two renames.
        backup = None
        if self.final_dir.exists():
            backup = self.final_dir.parent / f".{self.final_dir.name}.old-{os.getpid()}"
            os.rename(self.final_dir, backup)
        os.rename(self.tmp, self.final_dir)
        _fsync_dir(self.final_dir.parent)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        return self.final_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def recover(root: Path) -> None:
    """Undo a crash between the two renames of a same-step replacement; drop stale temps."""
    if not root.is_dir():
        return
    for backup in root.glob(".step_*.old-*"):
        final = root / backup.name[1:].split(".old-")[0]
        if final.exists():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(backup, final)


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete or not a checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    missing = [
        k
        for k in ("kind", "step", "files", "tables")
        if not isinstance(manifest, dict) or k not in manifest
    ]
    if missing:
        raise CheckpointError(f"{mpath}: not a complete manifest (no {', '.join(missing)})")
    return manifest


def verify(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest or raises naming the file."""
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"{f}: {size} bytes, the manifest says {info['bytes']} (truncated?)"
            )
        if checksums and zlib.crc32(f.read_bytes()) != info["crc32"]:
            raise CheckpointError(f"{f}: checksum mismatch (corrupted)")
    return manifest


def read_array(path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A stored array, memory-mapped (slices read only what they touch)."""
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path / name, dtype=dtype, mode="r", shape=shape)
