"""The ssd tier's file: rows read and written in batches with many requests in flight,
at positions that put the rows likely to be wanted together side by side.

::

    file        [num_rows, width] fp32   row r (with its optimizer state packed after it)
                                         at file row position[r]
    position    [num_rows] int32/int64   logical row -> file row (None: the identity)

A batch of rows is sorted by file position, adjacent rows coalesced into one request, and
the requests issued with pread/pwrite (native ``recscale_row_io``): first each without
waiting for the disk (``RWF_NOWAIT``: what the page cache holds is copied at once, on
the calling thread), then the rest from ``depth`` threads at once, so up to ``depth``
disk reads are in flight instead of the one a page fault gives. The file is never
mapped into the training process on this path: the pages the kernel evicts to make room
need no unmapping, whose TLB shootdowns measured a 1.45x slower step beyond RAM
(docs/performance.md). A file the page cache holds whole (``access=auto``: at most half
the memory available when it is made) is read and written through its memory map
instead: a copy a row, no system call (the pread path spends ~1.3 us a row in the
kernel even when the page is cached). ``POSIX_FADV_RANDOM``: no read-ahead of
neighbours nobody asked for. Whatever memory the process does not use keeps recently
used pages - and, with rows ordered by frequency, a page holds ~60 rows of similar heat,
so that memory caches the warm rows just beyond the hot-row cache. Without the native
library numpy indexes the memory map, one fault at a time (``map``: also the tests'
view). ``direct`` (opt-in) is the batched path through a second descriptor opened with
``O_DIRECT`` (``row_io.row_io_direct``): whole 4 KiB blocks, a write's partly covered
blocks read first, no page cache - ~45% less kernel CPU a read, but no page cache to
answer warm rows either (docs/tiered_storage.md says when it pays); the file is padded
to whole blocks, and a filesystem that refuses ``O_DIRECT`` (tmpfs) gets ``pread``.

Once settled before step 0 (``settle``), a mapped file that fits (the same test) is
read whole into the process's memory for the run (an array numpy backs with huge pages
where the kernel allows them): the run's writes stay there, never written back mid-run.
Through the shared map the kernel wrote dirty pages back 30 s after they were dirtied
(``vm.dirty_expire_centisecs``), write-protecting each (TLB shootdowns on every core) so
that the next write faulted again - over a 1,700-step run of config A at a 10% cache
the mean rate fell to 0.73 of the median. A copy-on-write map of the file kept the
writes off it but paid a fault the first time each 4 KB page was read and again when it
was first written (~0.5 us a row averaged over 400 steps of config A, against ~21 ns a
row in the loaded array; docs/performance.md). The array takes the file's size, which
fits in half the memory available.

The file is scratch space for one run (a crash leaves it as it may be; checkpoints store
rows by id, whatever their order here).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recscale import native
from recscale.embedding.row_io import (  # noqa: F401  (io_uring_available re-exported)
    DIRECT_BLOCK,
    io_uring_available,
    open_direct,
    row_copy,
    row_io,
    row_io_direct,
    row_move,
)
from recscale.launch_env import local_world_size
from recscale.procfs import mem_available
from recscale.units import size_text

TEMP_DIR_PREFIX = "recscale-ssd-"  # the ssd_dir recscale makes when none is given
ACCESS = ("auto", "pread", "direct", "map")
SEGMENT_CHUNK_ROWS = 1 << 20  # rows an initial segment writes at once (68 MB at width 17)
RowMaker = Callable[[np.ndarray], np.ndarray]  # segment-relative rows -> [n, width] fp32
# access=auto maps a file of at most this share of the memory available when it is made:
# the page cache then holds all of it and nothing evicts a mapped page
MAP_SHARE = 0.5


def fits_in_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` of file take at most ``MAP_SHARE`` of the memory available now,
    shared among the ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return nbytes <= MAP_SHARE * mem_available() / local_world_size()


class TierFileError(RuntimeError):
    """The ssd tier's file cannot be made or used: in use by another run, no space, no
    access, an I/O error."""


def remove_empty_temp_dirs(directory: Path) -> None:
    """Remove ``directory`` and its parents up to the ``recscale-ssd-*`` directory that
    recscale made in the temp dir, each only once it is empty (the last table file of a
    run takes them). A directory the user named (``embedding.ssd_dir``) is never one of
    them: it is left as it was."""
    tmp = Path(tempfile.gettempdir()).resolve()
    chain = [directory.resolve(), *directory.resolve().parents]
    top = next((d for d in chain if d.parent == tmp and d.name.startswith(TEMP_DIR_PREFIX)), None)
    if top is None:
        return
    for d in chain:
        try:
            d.rmdir()  # only an empty directory goes
        except OSError:
            return
        if d == top:
            return


def _remove(path: Path, fd: int, fds: list[int]) -> None:
    path.unlink(missing_ok=True)
    for other in fds:  # the O_DIRECT descriptor, if any
        os.close(other)
    os.close(fd)  # releases the lock
    remove_empty_temp_dirs(path.parent)


def _first_non_directory(folder: Path) -> Path:
    """The first existing part of ``folder`` (outermost first) that is not a directory."""
    for part in reversed([folder, *folder.parents]):
        if part.exists() and not part.is_dir():
            return part
    return folder


def claim_file(path: Path, nbytes: int) -> int:
    """Lock ``path`` for this process (another run sharing the ssd_dir would truncate and
    corrupt it), then create it with all ``nbytes`` reserved up front (a full disk fails
    here with a message, not later with a bus error in the middle of training).
    Returns the locked file descriptor (held until the file is closed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # never through a link (a planted one would have us truncate its target), and
        # only a regular file (a FIFO or device would hang or be overwritten)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            why = "it is a symbolic link, which recscale never writes through"
        elif e.errno in (errno.EEXIST, errno.ENOTDIR) and not path.parent.is_dir():
            why = f"{_first_non_directory(path.parent)} is not a directory"  # e.g. /dev/null
        else:
            why = e.strerror
        raise TierFileError(
            f"cannot create the ssd tier's file {path}: {why} "
            "(set --embedding.ssd_dir to a directory of this run's own)"
        ) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TierFileError(
            f"{path} exists and is not a regular file: recscale leaves it alone; "
            "set --embedding.ssd_dir to a directory of this run's own"
        )
    os.set_blocking(fd, True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TierFileError(
            f"{path} is in use by another training run: give each run its own "
            "--embedding.ssd_dir (by default each run uses RUN_DIR/embeddings)"
        ) from None
    try:
        os.ftruncate(fd, 0)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.ftruncate(fd, 0)
        free = shutil.disk_usage(path.parent).free
        os.close(fd)
        path.unlink(missing_ok=True)
        raise TierFileError(
            f"cannot reserve {size_text(nbytes)} for the ssd tier's file {path} "
            f"({e.strerror}; {size_text(free)} free there): free space, or point "
            "--embedding.ssd_dir at a larger disk"
        ) from e
    return fd


@dataclass
class IOStats:
    rows_read: int = 0
    rows_written: int = 0
    requests: int = 0  # reads + writes issued (adjacent rows coalesced into one)
    batches: int = 0  # calls: each issues its requests with up to `depth` in flight
    seconds: float = 0.0  # spent in batched reads and writes (any thread)

    def as_dict(self) -> dict[str, float]:
        return {
            "rows_read": self.rows_read,
            "rows_written": self.rows_written,
            "io_requests": self.requests,
            "io_batches": self.batches,
            "io_seconds": self.seconds,
        }


class RowFile:
    """``num_rows`` rows of ``width`` fp32 in a file at ``path`` (created, reserved and
    locked here; removed when this object goes). ``depth``: requests in flight per
    batched read or write (1 = one at a time). ``access``: ``pread`` (the batched
    requests above), ``direct`` (the same through ``O_DIRECT``: whole blocks, no page
    cache - pread where the filesystem refuses it), ``map`` (numpy on the file's memory
    map: a copy, no system call, for a file the page cache holds whole) or ``auto`` (map
    when the file takes at most ``MAP_SHARE`` of the memory available now, else pread;
    map without the native library)."""

    def __init__(
        self, path: Path, num_rows: int, width: int, depth: int = 32, access: str = "auto"
    ) -> None:
        if access not in ACCESS:
            raise ValueError(f"ssd access must be one of {ACCESS}, got {access!r}")
        self.path, self.num_rows, self.width, self.depth = Path(path), num_rows, width, depth
        self.row_bytes = width * 4
        if access == "auto":
            access = "map" if fits_in_memory(num_rows * self.row_bytes) else "pread"
        self.access = access
        nbytes = num_rows * self.row_bytes
        if access == "direct":  # O_DIRECT reads whole blocks: the last one too
            nbytes = -(-nbytes // DIRECT_BLOCK) * DIRECT_BLOCK
        self.fd = claim_file(self.path, nbytes)
        self.direct_fd: int | None = None
        self.direct_refused = ""  # why access=direct fell back to pread
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        # mapped through the descriptor just checked, not by name again
        with open(self.fd, "r+b", closefd=False) as f:
            self.map = np.memmap(f, dtype=np.float32, mode="r+", shape=(num_rows, width))
        # Rows are read at random: without this each fault would read the kernel's
        # read-ahead window (128 KB+) for one 68-byte row.
        if hasattr(mmap, "MADV_RANDOM") and getattr(self.map, "_mmap", None) is not None:
            self.map._mmap.madvise(mmap.MADV_RANDOM)
        self.loaded = False  # the rows are loaded into memory for the run (``settle``)
        self.position: np.ndarray | None = None
        self.stats = IOStats()
        self._lib = native.library()
        if self._lib is None or depth <= 0:
            self.access = "map"
        if self.access == "direct":
            self.direct_fd, self.direct_refused = open_direct(self.fd)
            if self.direct_fd is None:
                self.access = "pread"
        fds = [] if self.direct_fd is None else [self.direct_fd]
        self._finalizer = weakref.finalize(self, _remove, self.path, self.fd, fds)

    # -- order ----------------------------------------------------------------------------
    def set_order(self, position: np.ndarray | None) -> None:
        """Logical row -> file row (a permutation of ``range(num_rows)``), or None for the
        identity. Set before any row is written: rows already in the file do not move."""
        if position is not None:
            if position.shape != (self.num_rows,):
                raise ValueError(
                    f"a row order has one position per row ({self.num_rows:,}), "
                    f"got {position.shape}"
                )
            position = position.astype(np.int32 if self.num_rows < 2**31 else np.int64, copy=False)
        self.position = position

    def positions(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.position is None else self.position[rows].astype(np.int64)

    # -- batched I/O ----------------------------------------------------------------------
    def _check_mapped_size(self) -> None:
        """A mapped page past the end of a file cut short under the run is SIGBUS, not an
        error: check the size before a batch touches the map (one fstat; rows loaded into
        memory by ``settle`` no longer read the file)."""
        if self.loaded:
            return
        size, want = os.fstat(self.fd).st_size, self.num_rows * self.row_bytes
        if size < want:
            raise TierFileError(
                f"the ssd tier's file {self.path} was cut short under the run "
                f"({size:,} of {want:,} bytes)"
            )

    def _io(self, write: bool, pos: np.ndarray, buf: np.ndarray) -> None:
        """Rows ``buf[i]`` from / to file rows ``pos[i]`` (ascending for coalescing)."""
        t = time.perf_counter()
        if self.access == "map":  # numpy on the map: a copy, or one fault at a time
            self._check_mapped_size()
            if self._lib is not None:  # the next rows' misses overlapped (row_io.c)
                row_copy(self.map, write, pos, buf)
            elif write:
                self.map[pos] = buf
            else:
                buf[:] = self.map[pos]
            n = len(pos)
        else:
            if self.direct_fd is not None:
                n = row_io_direct(self.direct_fd, write, pos, buf, self.depth)
            else:
                n = row_io(self.fd, write, pos, buf, self.depth)
            if n < 0:
                what = "write to" if write else "read from"
                raise TierFileError(
                    f"cannot {what} the ssd tier's file {self.path}: {os.strerror(-n)}"
                )
        st = self.stats
        st.requests += n
        st.batches += 1
        st.seconds += time.perf_counter() - t

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), width]`` rows (any order, distinct)."""
        pos = self.positions(np.asarray(rows, dtype=np.int64))
        out = np.empty((len(pos), self.width), np.float32)
        if len(pos) == 0:
            return out
        order = np.argsort(pos, kind="stable")
        buf = np.empty_like(out)
        self._io(False, pos[order], buf)
        out[order] = buf
        self.stats.rows_read += len(pos)
        return out

    def write(self, rows: np.ndarray, data: np.ndarray) -> None:
        """Write whole rows (``data [len(rows), width]``; rows distinct)."""
        pos = self.positions(np.asarray(rows, dtype=np.int64))
        if len(pos) == 0:
            return
        order = np.argsort(pos, kind="stable")
        self._io(True, pos[order], np.ascontiguousarray(data[order], dtype=np.float32))
        self.stats.rows_written += len(pos)

    @property
    def moves_rows(self) -> bool:
        """Whether ``move`` can copy rows straight between this file and a CPU cache: in
        memory (loaded by ``settle``, or mapped) with the native library."""
        return self.access == "map" and self._lib is not None

    def move(self, rows: np.ndarray, slots: np.ndarray, parts: list, to_table: bool) -> None:
        """Rows ``rows`` to (``to_table``) or from cache ``slots`` (``row_move``), counted
        as reads or writes. Only where ``moves_rows``."""
        t = time.perf_counter()
        self._check_mapped_size()
        row_move(self.map, rows, slots, parts, to_table, self.position)
        st = self.stats
        st.requests += len(rows)
        st.batches += 1
        st.seconds += time.perf_counter() - t
        if to_table:
            st.rows_written += len(rows)
        else:
            st.rows_read += len(rows)

    def write_columns(self, rows: np.ndarray, lo: int, hi: int, values: np.ndarray) -> None:
        """Columns ``[lo, hi)`` of ``rows`` (the rest of each row kept)."""
        rows = np.asarray(rows, dtype=np.int64)
        data = self.read(rows)
        data[:, lo:hi] = values
        self.write(rows, data)

    def write_segment(
        self, start: int, n: int, make_rows: RowMaker, chunk: int = SEGMENT_CHUNK_ROWS
    ) -> None:
        """Whole rows ``[start, start + n)``, which fill a range of file rows, written in
        file order a chunk at a time (a table's initial values: no scattered writes to a
        file larger than memory, and only a chunk of rows in memory at once).
        ``make_rows(rel)`` gives the rows ``start + rel`` (``rel`` int64, any order) as
        ``[len(rel), width]`` fp32."""
        if self.position is None:
            lo, rel_at = start, None
        else:
            pos = self.position[start : start + n]
            lo = int(pos.min()) if n else start
            if n and int(pos.max()) - lo != n - 1:
                raise ValueError("a segment's rows must fill a range of file rows")
            rel_at = np.empty(n, np.int64)  # file row lo + k holds segment row rel_at[k]
            rel_at[pos.astype(np.int64) - lo] = np.arange(n, dtype=np.int64)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            rel = np.arange(a, b, dtype=np.int64) if rel_at is None else rel_at[a:b]
            data = np.ascontiguousarray(make_rows(rel), dtype=np.float32)
            self._io(True, np.arange(lo + a, lo + b, dtype=np.int64), data)  # 256 KB requests

    def flush(self) -> None:
        if not self.loaded:  # a loaded file's rows are the run's own (module doc)
            self.map.flush()

    def settle(self, taken: int = 0) -> int:
        """Wait until the rows written so far are on the disk (``fdatasync``), then, for
        a mapped file that fits in ``MAP_SHARE`` of the memory available beside the
        ``taken`` bytes other files of this process already hold, read it whole into
        memory for the run (module doc). Returns the bytes now held (0 or the file's).
        Called once the tables are initialized (or restored), before step 0 and before
        any other thread uses the file: otherwise the kernel writes those dirty pages
        back 30 s on, in the middle of training - config A at a 10% cache lost 3-4x on
        the steps it overlapped."""
        os.fdatasync(self.fd)
        nbytes = self.num_rows * self.row_bytes
        if self.loaded:
            return nbytes
        if self.access != "map" or not fits_in_memory(taken + nbytes):
            return 0  # a file the memory may not hold keeps pages the kernel can drop
        rows = np.empty(self.map.shape, np.float32)  # numpy advises huge pages for it
        view = memoryview(rows.reshape(-1).view(np.uint8))
        chunk = 64 << 20
        for at in range(0, nbytes, chunk):
            part = view[at : at + chunk]
            if hasattr(os, "preadv"):
                got = os.preadv(self.fd, [part], at)
            else:  # no preadv (macOS before 11): a copy through bytes
                data = os.pread(self.fd, len(part), at)
                part[: len(data)] = data
                got = len(data)
            if got != len(part):  # the file cut short under the run, or a read error
                raise TierFileError(
                    f"the ssd tier's file {self.path} read {got:,} of {len(part):,} bytes "
                    f"at {at:,} while loading it into memory"
                )
        self.map, self.loaded = rows, True
        return nbytes


class HostRows:
    """The host tier's rows: the same interface over a host array (pinned under CUDA),
    in id order."""

    loaded = True  # in this process's memory, as a loaded RowFile's
    moves_rows = False  # through buffers (``RowFile.move`` is the file's)

    def __init__(self, array: np.ndarray) -> None:
        self.map, self.position, self.stats = array, None, IOStats()

    def read(self, rows: np.ndarray) -> np.ndarray:
        self.stats.rows_read += len(rows)
        return self.map[rows]

    def write(self, rows: np.ndarray, data: np.ndarray) -> None:
        self.stats.rows_written += len(rows)
        self.map[rows] = data

    def write_columns(self, rows: np.ndarray, lo: int, hi: int, values: np.ndarray) -> None:
        self.map[rows, lo:hi] = values

    def write_segment(
        self, start: int, n: int, make_rows: RowMaker, chunk: int = SEGMENT_CHUNK_ROWS
    ) -> None:
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            self.map[start + a : start + b] = make_rows(np.arange(a, b, dtype=np.int64))

    def flush(self) -> None:
        pass
