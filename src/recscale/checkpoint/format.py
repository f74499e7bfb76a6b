"""On-disk format: one directory per checkpoint, a manifest written last, atomic rename.

::

    checkpoints/step_00000100/          full checkpoint
        manifest.json                   kind, step, parent, precision, files {name: {bytes, crc32}}
        trainer.json                    step, loader position, RNG state, config, plan
        dense.pt                        MLP weights + dense optimizer state (torch.save)
        tables/C1.weight.f32            rows of table C1 (or .f16 / .q8 + C1.qparams.f32)
        tables/C1.state_sum.f32         optimizer state rows
    checkpoints/step_00000150.inc/      incremental: only rows touched since the previous one
        tables/C1.rows.i64              which rows (table-local ids) follow
        ...

Tables are stored per feature in table-local row order - a layout that does not
depend on how the tables were batched or sharded, so a checkpoint can be loaded
under another plan.

A checkpoint is written under ``.NAME.tmp-PID``: every file is fsynced, the
manifest (with a CRC32 and size per file) is written and fsynced last, then the
directory is renamed to its final name and the parent directory fsynced. A crash
at any moment leaves the previous checkpoints untouched; a damaged checkpoint
fails :func:`verify`, which names the file.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    def __init__(self, final_dir: Path) -> None:
        self.final_dir = final_dir
        self.tmp = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        (self.tmp / "tables").mkdir(parents=True)
        self.files: dict[str, dict[str, int]] = {}

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        path = self.tmp / name
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}

    def write_array(self, name: str, array: np.ndarray) -> None:
        self.write_bytes(name, memoryview(np.ascontiguousarray(array)).cast("B"))

    def finalize(self, manifest: dict[str, Any]) -> Path:
        manifest = {**manifest, "format_version": FORMAT_VERSION, "files": self.files}
        data = json.dumps(manifest, indent=1).encode()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp / "tables")
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
        return json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e


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
    return np.fromfile(path / name, dtype=dtype).reshape(shape)
