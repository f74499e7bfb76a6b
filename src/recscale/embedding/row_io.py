"""The native calls of the ssd tier's file (``row_file.RowFile``): batched reads and
writes of rows at depth (``row_io``, ``row_io_direct`` through ``O_DIRECT``), and copies
of rows between a file held in memory and a buffer or the cache's slots (``row_copy``,
``row_move``). Each a thin checked wrapper of a function of ``native/row_io.c`` or
``native/row_direct.c``; the native library must be loaded.

::

    file    [R, width] fp32 rows        buf [n, width]: row i <-> file row pos[i]
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from recscale import native

DIRECT_BLOCK = 4096  # access=direct: the unit the disk is asked for (a page, >= its block)


IO_ENGINES = {"auto": 0, "threads": 1, "io_uring": 2}


def io_uring_available() -> bool:
    """Whether this process can use io_uring for the tier's reads and writes (a kernel
    that has it, not forbidden by seccomp or ``RECSCALE_IO_URING=0``)."""
    lib = native.library()
    return lib is not None and bool(lib.recscale_io_uring_available())


def row_io(
    fd: int,
    write: bool,
    pos: np.ndarray,
    buf: np.ndarray,
    depth: int,
    engine: str = "auto",
    nowait_first: bool = True,
) -> int:
    """Rows ``buf[i]`` (``buf [n, row_bytes]``, C-contiguous) from / to file rows
    ``pos[i]`` of ``fd`` through the native ``recscale_row_io`` (adjacent rows one
    request, up to ``depth`` in flight; what waits for the disk through io_uring where
    it can be had, else ``depth`` threads - ``engine`` forces one; ``nowait_first``
    False: no page-cache pass first, every request through the engine). Returns the
    requests issued, or -errno (-ENOSYS: ``io_uring`` forced where there is none); the
    native library must be loaded."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)  # referenced until the call returns
    return native.library().recscale_row_io(
        *_rows_args(fd, write, pos, buf), depth, IO_ENGINES[engine] | (0 if nowait_first else 4)
    )


def _rows_args(fd: int, write: bool, pos: np.ndarray, buf: np.ndarray) -> tuple:
    """The leading (fd, write, pos, n, row_bytes, buf) of the native row I/O calls."""
    n = len(pos)
    ptr = ctypes.c_void_p
    return (
        fd,
        int(write),
        pos.ctypes.data_as(ptr),
        n,
        buf.nbytes // max(n, 1),
        buf.ctypes.data_as(ptr),
    )


def row_io_direct(fd: int, write: bool, pos: np.ndarray, buf: np.ndarray, depth: int) -> int:
    """``row_io`` through a descriptor opened with ``O_DIRECT`` (native
    ``recscale_row_io_direct``): whole ``DIRECT_BLOCK`` blocks from the disk through an
    aligned bounce buffer, a write's partly covered blocks read first. ``pos`` strictly
    ascending; the file padded to whole blocks. Returns the requests issued or -errno."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)  # referenced until the call returns
    return native.library().recscale_row_io_direct(
        *_rows_args(fd, write, pos, buf), depth, IO_ENGINES["auto"], DIRECT_BLOCK
    )


def open_direct(fd: int) -> tuple[int | None, str]:
    """A second descriptor of ``fd``'s file opened with ``O_DIRECT`` (through
    /proc/self/fd: the same inode, never the name again), or None and why not (no
    O_DIRECT on this system, a filesystem that refuses it - tmpfs)."""
    if not hasattr(os, "O_DIRECT"):
        return None, "no O_DIRECT on this system"
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT), ""
    except OSError as e:
        return None, f"O_DIRECT refused: {e.strerror}"


def row_copy(table: np.ndarray, write: bool, pos: np.ndarray, buf: np.ndarray) -> None:
    """``buf[i] = table[pos[i]]`` (or ``table[pos[i]] = buf[i]`` to write) for a
    C-contiguous ``table [R, width]`` (a file's map) and ``buf [n, width]`` of its dtype,
    through the native ``recscale_row_copy`` (the next rows prefetched while one is
    copied); ``pos`` must lie in ``[0, R)``. The native library must be loaded."""
    if not (table.flags.c_contiguous and buf.flags.c_contiguous and table.dtype == buf.dtype):
        raise ValueError("row_copy needs C-contiguous arrays of one dtype")
    if buf.shape != (len(pos), table.shape[1]):
        raise ValueError(f"row_copy: buf is {buf.shape}, want ({len(pos)}, {table.shape[1]})")
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= table.shape[0]):
        raise IndexError(f"row_copy: a row outside [0, {table.shape[0]:,})")
    native.library().recscale_row_copy(
        table.ctypes.data_as(ctypes.c_void_p),
        int(write),
        pos.ctypes.data_as(ctypes.c_void_p),
        len(pos),
        table.shape[1] * table.itemsize,
        buf.ctypes.data_as(ctypes.c_void_p),
    )


MOVE_SPLIT_ROWS = 2048  # fewer rows are moved on the calling thread alone


def row_move(
    table: np.ndarray,
    rows: np.ndarray,
    slots: np.ndarray,
    parts: list[tuple[torch.Tensor, int]],
    to_table: bool,
    position: np.ndarray | None = None,
    split: bool = True,
) -> None:
    """Rows between ``table [R, width]`` and cache ``slots`` with no buffer between
    (native ``recscale_row_move``): entry i is file row ``position[rows[i]]`` (``position``
    None: ``rows[i]``); ``parts`` are ``(cache, col)`` - a C-contiguous float32 CPU tensor
    ``[C, w]`` (or ``[C]``: w = 1) holding columns ``[col, col + w)`` of each row.
    ``to_table``: a write-back, else an install. ``split``: 2,048 rows or more are split
    over torch's threads (False: all on the calling thread - a background thread's move
    beside a step that has the team busy). Bounds are checked (rows and slots here, file
    rows in the pass). The native library must be loaded."""
    if not table.flags.c_contiguous or table.dtype != np.float32:
        raise ValueError("row_move needs a C-contiguous float32 table")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if rows.shape != slots.shape:
        raise ValueError(f"row_move: {rows.shape[0]} rows for {slots.shape[0]} slots")
    if len(rows) == 0:
        return
    limit = table.shape[0] if position is None else position.shape[0]
    if int(rows.min()) < 0 or int(rows.max()) >= limit:
        raise IndexError(f"row_move: a row outside [0, {limit:,})")
    if position is not None and position.dtype != np.int32:  # the pass maps int32 only
        rows, position = position[rows].astype(np.int64), None
        if int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]:
            raise IndexError("row_move: a row's file row is outside the table")
    if int(slots.min()) < 0 or int(slots.max()) >= min(cache.shape[0] for cache, _ in parts):
        raise IndexError(f"row_move: a slot outside the cache ({int(slots.max())})")
    bases, widths, cols = [], [], []
    for cache, col in parts:
        w = int(cache[0].numel()) if cache.dim() > 1 else 1
        if not (cache.is_contiguous() and cache.dtype == torch.float32) or cache.is_cuda:
            raise ValueError("row_move needs C-contiguous float32 CPU caches")
        if col < 0 or col + w > table.shape[1]:
            raise IndexError(f"row_move: columns [{col}, {col + w}) outside the row")
        bases.append(cache.data_ptr())
        widths.append(w)
        cols.append(col)
    base, width, column = (np.asarray(x, dtype=np.int64) for x in (bases, widths, cols))
    if position is not None:
        position = np.ascontiguousarray(position)
    head = (
        table.ctypes.data,
        table.shape[1],
        table.shape[0],
        None if position is None else position.ctypes.data,
    )
    tail = (int(to_table), len(parts), base.ctypes.data, width.ctypes.data, column.ctypes.data)

    def part(_p: int, lo: int, hi: int) -> tuple:
        return (*head, rows.ctypes.data + 8 * lo, slots.ctypes.data + 8 * lo, hi - lo, *tail)

    # Each row is a few cache misses on each side: a second thread overlaps twice as many
    # (rows and slots are distinct, so the parts never write the same memory).
    threads = torch.get_num_threads() if split and len(rows) >= MOVE_SPLIT_ROWS else 1
    rcs = native.parallel_call(native.library(), "recscale_row_move", len(rows), part, threads)
    if min(rcs) < 0:  # a part stops at its first bad entry (the rest of it unmoved)
        raise IndexError("row_move: a row's file row is outside the table")
