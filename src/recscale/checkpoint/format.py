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
import re
import shutil
import stat
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from recscale.config.small_files import loads_json

MANIFEST = "manifest.json"
FORMAT_VERSION = 3  # 3: the manifest carries its own CRC (manifest_crc32)
_CKPT_NAME = re.compile(r"^step_\d{8}(\.inc)?$")
PRECISIONS = {
    "fp32": (".weight.f32",),
    "fp16": (".weight.f16",),
    "int8": (".weight.q8", ".qparams.f32"),
}
_ITEM = {".weight.f32": 4, ".weight.f16": 2, ".weight.q8": 1}


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
            parts.append(loads_json(path.read_text()))
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
        manifest["manifest_crc32"] = manifest_crc(manifest)
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


def manifest_crc(manifest: dict[str, Any]) -> int:
    """CRC32 of the manifest's canonical JSON without its own CRC field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _inside(name: object) -> bool:
    """A plain relative path with no ``..`` (what every file a manifest names must be)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not name.startswith("/")
        and "\\" not in name
        and all(p not in ("", ".", "..") for p in name.split("/"))
    )


def checked_file(ckpt: Path, name: object) -> Path:
    """``ckpt / name`` when ``name`` is a plain relative path inside the checkpoint that
    names a regular file (no ``..``, no absolute path, no symbolic link on the way, no
    FIFO or device): a forged manifest cannot make a restore read anything else."""
    if not _inside(name):
        raise CheckpointError(f"{ckpt}: the manifest names a file {name!r} outside it")
    parts = name.split("/")
    cur = ckpt
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise CheckpointError(f"{cur}: missing") from None
        except OSError as e:
            raise CheckpointError(f"{cur}: unreadable ({e.strerror})") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{cur}: a symbolic link in a checkpoint; refused")
        if last and not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{cur}: not a regular file; refused")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{cur}: not a directory")
    return cur


def _int(v: object, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{what} is {v!r}")
    return v


def check_manifest(manifest: dict[str, Any]) -> None:
    """The manifest's own consistency, as for any data read from disk: its CRC, the
    kinds and names it uses, each table's parts inside the table and (full checkpoints)
    tiling it exactly, and every file a part needs listed with the size its shape
    implies. Raises ValueError naming what is wrong."""
    if "manifest_crc32" in manifest:
        if manifest["manifest_crc32"] != manifest_crc(manifest):
            raise ValueError("manifest checksum mismatch (edited or damaged)")
    elif _int(manifest.get("format_version", 1), "format_version", 1) >= 3:
        raise ValueError("no manifest_crc32 in a format-3 manifest")
    kind, precision = manifest["kind"], manifest.get("precision", "fp32")
    if kind not in ("full", "incremental"):
        raise ValueError(f"kind is {kind!r}")
    if kind == "incremental" and not _CKPT_NAME.match(str(manifest.get("parent"))):
        raise ValueError(f"parent is {manifest.get('parent')!r}, not a checkpoint name")
    if precision not in PRECISIONS:
        raise ValueError(f"precision is {precision!r}")
    _int(manifest["step"], "step")
    files = manifest["files"]
    if not isinstance(files, dict) or not isinstance(manifest["tables"], list):
        raise ValueError("files or tables are not a mapping and a list")
    for name, info in files.items():
        if not _inside(name):
            raise ValueError(f"it names a file {name!r} outside the checkpoint")
        if not isinstance(info, dict):
            raise ValueError(f"file {name!r} has no size and checksum")
        _int(info.get("bytes"), f"{name}'s bytes")
        _int(info.get("crc32"), f"{name}'s crc32")
    seen = set()
    for t in manifest["tables"]:
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"a table entry without a name of its own ({name!r})")
        seen.add(name)
        rows, dim = (
            _int(t.get("num_rows"), f"{name}'s num_rows"),
            _int(t.get("dim"), f"{name}'s dim", 1),
        )
        if "parts" not in t:
            continue  # version 1: one whole part, checked by its files' sizes at restore
        area = 0
        boxes = []
        for sp in t["parts"]:
            r0, r1 = _int(sp.get("row_lo"), "row_lo"), _int(sp.get("row_hi"), "row_hi")
            c0, c1 = _int(sp.get("col_lo"), "col_lo"), _int(sp.get("col_hi"), "col_hi")
            if not (r0 < r1 <= rows and c0 < c1 <= dim):
                raise ValueError(
                    f"{name}: part rows {r0}-{r1} x cols {c0}-{c1} outside {rows} x {dim}"
                )
            n = _int(sp.get("stored_rows"), f"{name}'s stored_rows")
            if kind == "full" and n != r1 - r0:
                raise ValueError(f"{name}: a full part of rows {r0}-{r1} stores {n} rows")
            if n > r1 - r0:
                raise ValueError(f"{name}: {n} rows stored of a part of {r1 - r0}")
            prefix = sp.get("prefix")
            if not _inside(prefix):
                raise ValueError(f"{name}: a part's files {prefix!r} are outside the checkpoint")
            need = {
                prefix + suffix: n * (c1 - c0) * _ITEM.get(suffix, 4)
                for suffix in PRECISIONS[precision]
            }
            if precision == "int8":
                need[prefix + ".qparams.f32"] = n * 2 * 4
            state = sp.get("state", {})
            if not isinstance(state, dict):
                raise ValueError(f"{name}: state is not a mapping")
            for sname, tail in state.items():
                if not isinstance(tail, list) or not all(
                    isinstance(x, int) and x >= 0 for x in tail
                ):
                    raise ValueError(f"{name}: state {sname!r} has shape {tail!r}")
                need[f"{prefix}.state_{sname}.f32"] = 4 * n * math.prod(tail)
            if kind == "incremental":
                need[prefix + ".rows.i64"] = 8 * n
            for fname, nbytes in need.items():
                if fname not in files:
                    raise ValueError(f"{name}: {fname} is not among the checkpoint's files")
                if files[fname]["bytes"] != nbytes:
                    raise ValueError(
                        f"{fname}: {files[fname]['bytes']} bytes listed, its shape needs {nbytes}"
                    )
            for b in boxes:
                if r0 < b[1] and b[0] < r1 and c0 < b[3] and b[2] < c1:
                    raise ValueError(f"{name}: parts overlap")
            boxes.append((r0, r1, c0, c1))
            area += (r1 - r0) * (c1 - c0)
        if kind == "full" and area != rows * dim:
            raise ValueError(f"{name}: its parts cover {area} of {rows * dim} values")


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete or not a checkpoint)")
    checked_file(path, MANIFEST)
    if mpath.stat().st_size > 64 << 20:
        raise CheckpointError(f"{mpath}: {mpath.stat().st_size:,} bytes, not a manifest")
    try:
        manifest = loads_json(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    missing = [
        k
        for k in ("kind", "step", "files", "tables")
        if not isinstance(manifest, dict) or k not in manifest
    ]
    if missing:
        raise CheckpointError(f"{mpath}: not a complete manifest (no {', '.join(missing)})")
    try:
        check_manifest(manifest)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: inconsistent manifest: {e}") from None
    return manifest


# Files this process has checksummed, by identity: (device, inode, size, mtime, ctime)
# -> their CRC. A restore verifies the chain that resolve_chain verified a moment
# before: config B's 13 GB were read and summed twice (15 s of a 70 s eval). A file
# rewritten or replaced since has another inode or ctime (which cannot be set back),
# so it is summed again - provided its ctime had settled: file times tick coarsely
# (a few ms), so a file changed within the last second is never remembered.
_SUMMED: dict[tuple[int, ...], int] = {}
_SETTLED_NS = 1_000_000_000
_CRC_BLOCK = 16 << 20  # read and summed a block at a time: memory stays flat


def _crc_of(f: Path, size: int) -> int:
    """The file's CRC32, a block at a time, the next block read on a thread while this
    one is summed (both let go of the GIL): 3.9 against 2.7 GB/s from the page cache
    (2026-11-28, 2-vCPU Zen 4 VM)."""
    blocks = [bytearray(min(_CRC_BLOCK, max(size, 1))) for _ in range(2)]
    crc, i = 0, 0
    with (
        open(f, "rb", buffering=0) as fh,
        ThreadPoolExecutor(1, thread_name_prefix="recscale-crc") as reader,
    ):
        pending = reader.submit(fh.readinto, blocks[0])
        while n := pending.result():
            pending = reader.submit(fh.readinto, blocks[1 - i])
            crc = zlib.crc32(memoryview(blocks[i])[:n], crc)
            i = 1 - i
    return crc


def _file_crc(f: Path, st: os.stat_result) -> int:
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _SUMMED:
        return _SUMMED[key]
    crc = _crc_of(f, st.st_size)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLED_NS:
        _SUMMED[key] = crc
    return crc


def verify(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest or raises naming the file.
    A file this process summed before and that has not changed since is not read again."""
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = checked_file(path, name)
        st = f.stat()
        if st.st_size != info["bytes"]:
            raise CheckpointError(
                f"{f}: {st.st_size} bytes, the manifest says {info['bytes']} (truncated?)"
            )
        if checksums and _file_crc(f, st) != info["crc32"]:
            raise CheckpointError(f"{f}: checksum mismatch (corrupted)")
    return manifest


def _sized_file(path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> Path:
    f = checked_file(path, name)
    want = math.prod(shape) * np.dtype(dtype).itemsize
    if f.stat().st_size != want:
        raise CheckpointError(f"{f}: {f.stat().st_size:,} bytes, its shape needs {want:,}")
    return f


def read_array(path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A stored array, memory-mapped (slices read only what they touch): a regular file
    inside the checkpoint, of exactly the size its shape needs."""
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(_sized_file(path, name, dtype, shape), dtype=dtype, mode="r", shape=shape)


def read_rows(
    path: Path, name: str, dtype: np.dtype, shape: tuple[int, ...], lo: int, hi: int
) -> np.ndarray:
    """Rows ``[lo, hi)`` of a stored array (checked as :func:`read_array`), read into
    memory of their own: one read a block, 3-4x the rate of copying them out of a
    memory map, which takes a page fault every 4 KiB (5.6 against 1.4 GB/s from the
    page cache, config B's rows, 2026-11-28)."""
    out = np.empty((hi - lo, *shape[1:]), dtype)
    if out.size == 0:
        return out
    f = _sized_file(path, name, dtype, shape)
    row = out.nbytes // (hi - lo)
    with open(f, "rb", buffering=0) as fh:
        fh.seek(lo * row)
        view, got = memoryview(out).cast("B"), 0
        while got < out.nbytes and (n := fh.readinto(view[got:])):
            got += n
    if got != out.nbytes:  # shrunk since its size was checked
        raise CheckpointError(f"{f}: ended at byte {lo * row + got:,} of {hi * row:,}")
    return out
