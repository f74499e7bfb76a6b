"""The disk under an ssd tier: its random-read rate at queue depth 1 and at the tier's
depth, and the reads a run actually took from it.

The probe reads 4 KiB blocks at random offsets over the tier's own file, after the run,
through ``O_DIRECT`` where the filesystem allows it (else buffered, the file's pages
dropped from the page cache first), with the same batched reader the tier uses. Why the
tier's file and not a small file of the probe's own: a virtual disk's host keeps a cache
of its own in front of the device, and it answers every read of a file that fits in it.
Measured on a 2-vCPU VM (AMD EPYC, virtio ext4, 2026-11-26): 36-60k reads/s over a 1 or
16 GiB file, 8.6-11.6k/s over a 48 GiB one, at depth 1 and 32 alike - and a run over a
38.9 GB tier read at 16k/s while the small probe had promised 50k. The tier's file is
as large as its tables, so the probe meets the disk the run met. Each depth reads until
``reads`` blocks or ``seconds`` have gone, so a slow disk costs seconds, not minutes.

``DiskCounters`` reads ``/proc/self/io``'s ``read_bytes`` / ``write_bytes``: what the
process made the storage layer transfer, so reads the page cache served do not count.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recscale import native
from recscale.embedding.row_io import row_io, row_io_direct

PAGE = 4096


def _open_uncached(path: Path) -> tuple[int, bool]:
    """A read descriptor of ``path`` whose reads the page cache cannot answer: O_DIRECT
    (read through the native library's aligned buffers), or (a filesystem that refuses it,
    e.g. tmpfs, or no native library) a plain one with the file's cached pages dropped.
    Returns (fd, direct)."""
    if hasattr(os, "O_DIRECT") and native.library() is not None:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, False


def _read_at_depth(
    fd: int, direct: bool, pages: np.ndarray, depth: int, chunk: int, seconds: float
) -> float:
    """Pages read per second: ``pages`` (ascending page numbers, distinct) in chunks of
    ``chunk`` at ``depth`` requests in flight, stopping after ``seconds``."""
    done, t = 0, time.perf_counter()
    for lo in range(0, len(pages), chunk):
        part = pages[lo : lo + chunk]
        buf = np.empty((len(part), PAGE), np.uint8)
        if native.library() is None:
            for p in part:
                os.pread(fd, PAGE, int(p) * PAGE)
        else:
            n = (row_io_direct if direct else row_io)(fd, False, part, buf, depth)
            if n < 0:
                raise OSError(-n, os.strerror(-n))
        done += len(part)
        if time.perf_counter() - t >= seconds:
            break
    return done / (time.perf_counter() - t)


def measure_file_read_iops(
    path: Path, depth: int, reads: int = 16384, seconds: float = 2.0
) -> dict[str, float]:
    """``{"qd1": reads/s, "qd<depth>": reads/s, "file_bytes": size, "direct": 0|1}``: 4 KiB
    random reads over the existing file ``path`` at depth 1 (a quarter of ``reads``, at
    most ``seconds / 2``) and at ``depth`` (``reads``, at most ``seconds``), bypassing the
    page cache (see the module docstring)."""
    size = os.stat(path).st_size
    n_pages = size // PAGE
    if n_pages < 2:
        raise OSError(f"{path} holds {size} bytes: too small to probe the disk")
    fd, direct = _open_uncached(path)
    try:
        rng = np.random.default_rng(1)
        out: dict[str, float] = {"file_bytes": float(size), "direct": float(direct)}
        for d, n, limit in ((1, reads // 4, seconds / 2), (depth, reads, seconds)):
            # distinct pages in file order, as the tier submits its rows: no page twice
            pages = np.sort(rng.choice(n_pages, size=min(n, n_pages // 2), replace=False))
            out[f"qd{d}"] = _read_at_depth(fd, direct, pages, d, max(d * 32, 64), limit)
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return out
    finally:
        os.close(fd)


@dataclass
class DiskCounters:
    """Bytes this process made the storage layer read and write since ``start``."""

    read_bytes: int = 0
    write_bytes: int = 0

    @staticmethod
    def now() -> DiskCounters:
        try:
            fields = dict(
                line.split(": ") for line in Path("/proc/self/io").read_text().splitlines()
            )
            return DiskCounters(int(fields["read_bytes"]), int(fields["write_bytes"]))
        except (OSError, KeyError, ValueError):
            return DiskCounters(-1, -1)

    def since(self, start: DiskCounters) -> DiskCounters:
        if self.read_bytes < 0 or start.read_bytes < 0:
            return DiskCounters(-1, -1)
        return DiskCounters(
            self.read_bytes - start.read_bytes, self.write_bytes - start.write_bytes
        )
