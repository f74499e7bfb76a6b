"""The native row I/O of the ssd tier (``embedding/row_io.py``): rows copied and moved
between a table in memory and buffers or cache slots, O_DIRECT block I/O, and the
io_uring rings' lifetime - each against numpy on the same arrays."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
import torch

from recscale import native
from recscale.embedding.row_file import RowFile
from recscale.embedding.row_io import row_copy, row_io, row_io_direct

needs_native = pytest.mark.skipif(native.library() is None, reason="native library not built")


def _file(tmp_path, rows, width, depth=32, order=None, access="auto"):
    rf = RowFile(tmp_path / "rows.f32", rows, width, depth, access)
    rf.set_order(order)
    return rf


@needs_native
@pytest.mark.parametrize("width", [1, 5, 18, 33])  # rows within a line, across lines
def test_the_native_row_copy_gathers_and_scatters_as_numpy_does(width):
    rng = np.random.default_rng(width)
    table = rng.standard_normal((3000, width)).astype(np.float32)
    ref = table.copy()
    pos = rng.choice(3000, 700, replace=False)  # any order: a prefetch runs ahead of it
    got = np.empty((700, width), np.float32)
    row_copy(table, False, pos, got)
    np.testing.assert_array_equal(got, ref[pos])
    new = rng.standard_normal((700, width)).astype(np.float32)
    row_copy(table, True, pos, new)
    ref[pos] = new
    np.testing.assert_array_equal(table, ref)  # the rows written, no other byte moved
    with pytest.raises(IndexError, match="outside"):
        row_copy(table, False, np.array([0, 3000]), np.empty((2, width), np.float32))
    with pytest.raises(ValueError, match="buf"):
        row_copy(table, False, pos, np.empty((699, width), np.float32))


@needs_native
@pytest.mark.skipif(native.library() is None, reason="the native library is not built")
def test_the_native_row_move_copies_between_a_table_and_cache_slots_both_ways():
    """A row's columns split over the cache's parts (weights [C, 3], a row-wise state [C],
    a [C, 2, 2] state), against numpy indexing, both directions; bad indices refused."""
    from recscale.embedding.row_io import row_move

    rng = np.random.default_rng(0)
    table = rng.standard_normal((500, 8)).astype(np.float32)
    weight, rowwise, square = torch.zeros(40, 3), torch.zeros(40), torch.zeros(40, 2, 2)
    parts = [(weight, 0), (rowwise, 3), (square, 4)]
    pos = rng.choice(500, 30, replace=False)
    slots = rng.choice(40, 30, replace=False)
    row_move(table, pos, slots, parts, to_table=False)
    assert np.array_equal(weight.numpy()[slots], table[pos, :3])
    assert np.array_equal(rowwise.numpy()[slots], table[pos, 3])
    assert np.array_equal(square.numpy()[slots].reshape(30, 4), table[pos, 4:])
    weight.mul_(-1)
    rowwise.add_(7)
    square.mul_(2)
    want = table.copy()
    want[pos, :3] *= -1
    want[pos, 3] += 7
    want[pos, 4:] *= 2
    row_move(table, pos, slots, parts, to_table=True)
    assert np.array_equal(table, want)
    with pytest.raises(IndexError, match="row outside"):
        row_move(table, np.array([500]), np.array([0]), parts, to_table=False)
    with pytest.raises(IndexError, match="slot outside"):
        row_move(table, np.array([0]), np.array([40]), parts, to_table=False)
    with pytest.raises(IndexError, match="columns"):
        row_move(table, np.array([0]), np.array([0]), [(square, 5)], to_table=False)


@needs_native
@pytest.mark.skipif(native.library() is None, reason="the native library is not built")
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_row_move_maps_logical_rows_through_the_file_order(dtype):
    """With a row order, entry i is file row position[rows[i]] (the pass maps int32
    orders itself, int64 ones are mapped first): equal to moving the mapped rows; a
    position outside the table is refused."""
    from recscale.embedding.row_io import row_move

    rng = np.random.default_rng(1)
    table = rng.standard_normal((300, 5)).astype(np.float32)
    position = rng.permutation(300).astype(dtype)
    rows = rng.choice(300, 50, replace=False)
    slots = rng.choice(64, 50, replace=False)
    got, want = torch.zeros(64, 4), torch.zeros(64, 4)
    got_state, want_state = torch.zeros(64), torch.zeros(64)
    row_move(table, rows, slots, [(got, 0), (got_state, 4)], False, position)
    row_move(table, position[rows], slots, [(want, 0), (want_state, 4)], False)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert np.array_equal(got.numpy()[slots], table[position[rows], :4])
    got.add_(1)
    row_move(table, rows, slots, [(got, 0), (got_state, 4)], True, position)
    assert np.array_equal(table[position[rows], :4], got.numpy()[slots])
    bad = position.copy()
    bad[rows[3]] = 300
    with pytest.raises(IndexError, match="outside the table"):
        row_move(table, rows, slots, [(got, 0)], False, bad)
    with pytest.raises(IndexError, match="row outside"):
        row_move(table, np.array([300]), np.array([0]), [(got, 0)], False, position)


def _direct_file(tmp_path, rows, width, depth=8):
    rf = _file(tmp_path, rows, width, depth, access="direct")
    if rf.direct_refused:
        pytest.skip(f"{tmp_path}: {rf.direct_refused}")
    return rf


@needs_native
@pytest.mark.parametrize("width", [1, 17, 1024, 1500, 3000])  # within, across 2 and 3 blocks
def test_direct_io_moves_whole_blocks_and_keeps_the_neighbours_of_each_row(tmp_path, width):
    """access=direct: rows in blocks shared with rows not written keep those rows' bytes
    (the read-modify-write of each partly covered block), rows straddling blocks whole,
    the file padded to whole blocks, and reads through the map see the direct writes."""
    n = 2003
    rng = np.random.default_rng(width)
    rf = _direct_file(tmp_path, n, width)
    assert rf.access == "direct"
    assert os.fstat(rf.fd).st_size % 4096 == 0 and os.fstat(rf.fd).st_size >= n * width * 4
    ref = rng.standard_normal((n, width)).astype(np.float32)
    rf.write_segment(0, n, lambda rel: ref[rel])
    np.testing.assert_array_equal(rf.read(np.arange(n)), ref)
    for _ in range(10):
        rows = rng.choice(n, int(rng.integers(1, 300)), replace=False)
        data = rng.standard_normal((len(rows), width)).astype(np.float32)
        rf.write(rows, data)
        ref[rows] = data
        probe = rng.choice(n, 200, replace=False)
        np.testing.assert_array_equal(rf.read(probe), ref[probe])
    np.testing.assert_array_equal(np.asarray(rf.map), ref)


@needs_native
def test_direct_io_refuses_rows_out_of_order(tmp_path):
    rf = _direct_file(tmp_path, 100, 4)
    buf = np.zeros((2, 4), np.float32)
    assert row_io_direct(rf.direct_fd, False, np.array([5, 3]), buf, 4) == -errno.EINVAL
    assert row_io_direct(rf.direct_fd, False, np.array([3, 3]), buf, 4) == -errno.EINVAL


def test_direct_access_falls_back_to_pread_where_o_direct_is_refused(tmp_path, monkeypatch):
    import recscale.embedding.row_file as row_file

    monkeypatch.setattr(row_file, "open_direct", lambda fd: (None, "O_DIRECT refused: test"))
    rf = _file(tmp_path, 100, 4, access="direct")
    if native.library() is None:
        assert rf.access == "map"
        return
    assert rf.access == "pread" and rf.direct_refused == "O_DIRECT refused: test"
    rf.write(np.array([7]), np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(rf.read(np.array([7])), np.ones((1, 4), np.float32))


def test_each_threads_io_ring_is_closed_when_the_thread_exits(tmp_path):
    """io_uring keeps one ring a thread; threads that read and exit leave no descriptor
    behind (a run starts a prefetch thread per pipeline)."""
    import threading

    from recscale.embedding.row_io import io_uring_available

    if not io_uring_available() or not os.path.isdir("/proc/self/fd"):
        pytest.skip("io_uring (or /proc) cannot be had here")
    data = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    path = tmp_path / "f"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    got = []

    def read():
        buf = np.empty((10, 4), np.float32)
        got.append(row_io(fd, False, np.arange(0, 1000, 100), buf, 4, "io_uring", False))
        np.testing.assert_array_equal(buf, data[::100])

    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            t = threading.Thread(target=read)
            t.start()
            t.join()
        assert got == [10] * 20
        # Thread.join returns when the thread's Python state is gone, a moment before the
        # OS thread runs its exit destructors (which close the ring): wait that moment out
        deadline = time.monotonic() + 5.0
        while len(os.listdir("/proc/self/fd")) != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(fd)


def _ring_read(fd, data, out):
    buf = np.empty((10, 4), np.float32)
    n = row_io(fd, False, np.arange(0, 1000, 100), buf, 4, "io_uring", False)
    out.append((n, bool(np.array_equal(buf, data[::100]))))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_reads_through_a_ring_of_its_own(tmp_path):
    """A thread's ring belongs to the process that set it up: its queues are shared
    memory, so a child forked after the parent read sets up its own (its reads could
    otherwise reap the parent's completions), and the parent's stays the parent's."""
    from recscale.embedding.row_io import io_uring_available

    if not io_uring_available():
        pytest.skip("io_uring cannot be had here")
    data = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    data.tofile(tmp_path / "f")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = []
        _ring_read(fd, data, got)  # this thread's ring, set up by this process
        pid = os.fork()
        if pid == 0:  # the child: the same thread, the parent's ring inherited
            ok = []
            try:
                _ring_read(fd, data, ok)
                ok.append(native.library().recscale_io_uring_owner() == os.getpid())
            finally:
                os._exit(0 if ok == [(10, True), True] else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _ring_read(fd, data, got)  # the parent's ring still its own
        assert got == [(10, True), (10, True)]
        assert native.library().recscale_io_uring_owner() == os.getpid()
    finally:
        os.close(fd)
