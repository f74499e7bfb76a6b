"""The disk under an ssd tier: its random-read rate at queue depth 1 and at the tier's
depth, and the reads a run actually took from it.

The probe writes a 1 GiB file of random bytes in the directory, syncs it and drops it
from the page cache (``POSIX_FADV_DONTNEED``), then reads 4 KiB pages at random offsets
through the same batched reader the tier uses (``recscale_row_io``), at depth 1 and at
``depth``. Readings are kept per device (``st_dev``) in this host's record
(``bench/hardware.record_path``) and reused: the probe runs once per disk.

``DiskCounters`` reads ``/proc/self/io``'s ``read_bytes`` / ``write_bytes``: what the
process made the storage layer transfer, so reads the page cache served do not count.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recscale import native
from recscale.bench.hardware import best_on_record, record_path
from recscale.embedding.row_io import row_io

PAGE = 4096


def _read_at_depth(fd: int, pages: np.ndarray, depth: int) -> float:
    """Seconds to read ``pages`` (page numbers) at ``depth`` requests in flight."""
    buf = np.empty((len(pages), PAGE), np.uint8)
    t = time.perf_counter()
    if native.library() is None:
        for p in pages:
            os.pread(fd, PAGE, int(p) * PAGE)
    else:
        n = row_io(fd, False, pages, buf, depth)
        if n < 0:
            raise OSError(-n, os.strerror(-n))
    return time.perf_counter() - t


def measure_random_read_iops(
    directory: Path, depth: int, file_bytes: int = 1 << 30, reads: int = 16384
) -> dict[str, float]:
    """4 KiB random reads per second from ``directory``'s disk at depth 1 and ``depth``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".recscale-disk-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
        for at in range(0, file_bytes, len(chunk)):
            os.write(fd, chunk[: file_bytes - at])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        rng = np.random.default_rng(1)
        n_pages = file_bytes // PAGE
        out = {}
        for d, n in ((1, reads // 4), (depth, reads)):
            # distinct pages, unsorted: no coalescing, no page read twice
            pages = rng.choice(n_pages, size=min(n, n_pages // 2), replace=False)
            out[f"qd{d}"] = len(pages) / _read_at_depth(fd, pages, d)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return out
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def disk_iops(directory: Path, depth: int, echo=lambda _m: None) -> dict[str, float]:
    """``{"qd1": iops, "qd<depth>": iops}`` of ``directory``'s disk: this host's record
    of that device, else a probe (recorded)."""
    directory.mkdir(parents=True, exist_ok=True)
    dev = os.stat(directory).st_dev
    keys = {f"qd{d}": f"disk/dev{dev}/randread4k/qd{d}" for d in (1, depth)}
    path = record_path()
    try:
        record = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        record = {}
    if all(k in record for k in keys.values()):
        return {name: float(record[k]) for name, k in keys.items()}
    echo(f"probing the disk under {directory} (4 KiB random reads, 1 GiB file) ...")
    measured = measure_random_read_iops(directory, depth)
    return {name: best_on_record(keys[name], measured[name]) for name in keys}


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
