"""The ssd tier's file: batched reads and writes at depth against a plain array, file
order by popularity, warm starts, the disk probe and their errors."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from recscale import native
from recscale.config import load_config
from recscale.config.errors import ConfigError
from recscale.embedding.cached_storage import CachedStorage, CacheTooSmallError
from recscale.embedding.optimizers import SparseSGD
from recscale.embedding.placement import file_order
from recscale.embedding.row_file import RowFile, TierFileError
from recscale.embedding.row_io import row_io
from recscale.train.data_source import make_synthetic, popularity_ranks
from recscale.train.run import train

needs_native = pytest.mark.skipif(native.library() is None, reason="native library not built")


def _file(tmp_path, rows=5000, width=5, depth=32, order=None, access="auto"):
    rf = RowFile(tmp_path / "rows.f32", rows, width, depth, access)
    rf.set_order(order)
    return rf


@pytest.mark.parametrize("depth", [0, 1, 32])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("access", ["pread", "direct", "map"])
def test_batched_reads_and_writes_match_an_array(tmp_path, depth, ordered, access):
    n, w = 5000, 5
    rng = np.random.default_rng(depth)
    order = rng.permutation(n) if ordered else None
    rf = _file(tmp_path, n, w, depth, order, access)
    if depth == 0 or native.library() is None:
        assert rf.access == "map"  # nothing else can serve it
    elif access == "direct" and rf.direct_refused:  # a filesystem without O_DIRECT
        assert rf.access == "pread" and rf.direct_fd is None
    else:
        assert rf.access == access
    ref = np.zeros((n, w), np.float32)
    for step in range(6):
        # unsorted distinct rows: runs of neighbours (coalesced) and scattered singles
        block = np.arange(step * 700, step * 700 + 300)
        rows = rng.permutation(np.concatenate([block, rng.choice(n, 200, replace=False)]))
        rows = np.unique(rows)[rng.permutation(len(np.unique(rows)))]
        data = rng.standard_normal((len(rows), w)).astype(np.float32)
        rf.write(rows, data)
        ref[rows] = data
        probe = rng.choice(n, 400, replace=False)
        np.testing.assert_array_equal(rf.read(probe), ref[probe])
    rf.write_columns(np.arange(10, 20), 1, 3, np.full((10, 2), 7.0, np.float32))
    ref[10:20, 1:3] = 7.0
    rf.write_columns(np.array([4000, 3]), 0, 1, np.array([[1.0], [2.0]], np.float32))
    ref[[4000, 3], 0:1] = [[1.0], [2.0]]
    np.testing.assert_array_equal(rf.read(np.arange(n)), ref)
    np.testing.assert_array_equal(rf.read(np.arange(n)[::-1]), ref[::-1])
    # the file holds each row at its position
    pos = np.arange(n) if order is None else order
    np.testing.assert_array_equal(np.asarray(rf.map)[pos], ref)
    assert rf.stats.rows_read > 0 and rf.stats.rows_written > 0


@pytest.mark.parametrize(
    "depth, engine, nowait_first",
    [(1, "auto", True), (8, "auto", True), (8, "threads", False), (1, "io_uring", False)]
    + [(8, "io_uring", False), (300, "io_uring", False)],
)
def test_the_pread_reader_coalesces_neighbours_and_reads_at_depth(
    tmp_path, depth, engine, nowait_first
):
    """``recscale_row_io`` (the tier's reader and the disk probe's): one request a run of
    neighbours, the rows where they are in the file, a failure as -errno - through the
    page-cache pass, the threads and io_uring (each forced, every request through it)."""
    from recscale.embedding.row_io import io_uring_available

    if engine == "io_uring" and not io_uring_available():
        pytest.skip("io_uring cannot be had here (kernel, seccomp or RECSCALE_IO_URING=0)")
    data = np.arange(10000 * 4, dtype=np.float32).reshape(10000, 4)
    path = tmp_path / "f"
    data.tofile(path)
    fd = os.open(path, os.O_RDWR)

    def io(write, pos, buf):
        return row_io(fd, write, pos, buf, depth, engine, nowait_first)

    try:
        buf = np.empty((100, 4), np.float32)
        assert io(False, np.arange(100, 200), buf) == 1
        np.testing.assert_array_equal(buf, data[100:200])
        pos = np.arange(0, 10000, 2)
        buf = np.empty((len(pos), 4), np.float32)
        assert io(False, pos, buf) == len(pos)  # no neighbours
        np.testing.assert_array_equal(buf, data[pos])
        buf = np.empty((10000, 4), np.float32)
        assert io(False, np.arange(10000), buf) == 1  # 160 KB: one run
        np.testing.assert_array_equal(buf, data)
        new = -np.ones((3, 4), np.float32)
        assert io(True, np.array([7, 8, 500]), new) == 2
        assert np.fromfile(path, np.float32).reshape(10000, 4)[[7, 8, 500]].tolist() == (
            new.tolist()
        )
        assert io(False, np.array([10005]), np.empty((1, 4), np.float32)) < 0  # past the end
    finally:
        os.close(fd)
    if engine == "io_uring":  # a request the kernel fails comes back as -errno (EBADF)
        one = np.empty((1, 4), np.float32)
        assert row_io(-1, False, np.array([0]), one, depth, engine, False) == -errno.EBADF


def test_a_segment_is_written_in_file_order(tmp_path):
    n = 100
    order = np.concatenate([np.random.default_rng(0).permutation(60), 60 + np.arange(40)[::-1]])
    rf = _file(tmp_path, n, 3, order=order)
    data = np.arange(60 * 3, dtype=np.float32).reshape(60, 3)
    rf.write_segment(0, 60, lambda rel: data[rel], chunk=7)  # chunks of file rows
    rf.write_segment(60, 40, lambda rel: -np.ones((len(rel), 3), np.float32))
    np.testing.assert_array_equal(rf.read(np.arange(60)), data)
    np.testing.assert_array_equal(rf.read(np.arange(60, 100)), -np.ones((40, 3)))
    bad = _file(tmp_path / "b", 10, 3, order=np.array([0, 9, 1, 2, 3, 4, 5, 6, 7, 8]))
    with pytest.raises(ValueError, match="fill a range"):
        bad.write_segment(0, 2, lambda rel: np.zeros((len(rel), 3), np.float32))


@pytest.mark.parametrize(
    "access, words",
    [
        pytest.param("pread", "cannot read from", marks=needs_native),
        pytest.param("direct", "cannot read from", marks=needs_native),
        ("map", "was cut short under the run"),  # not a SIGBUS from a mapped page
    ],
)
def test_a_failed_read_is_one_line_naming_the_file(tmp_path, access, words):
    rf = _file(tmp_path, 1000, 4, access=access)
    rf.read(np.arange(50))
    os.ftruncate(rf.fd, 100 * 16)  # rows 100.. gone (a file cut short under the run)
    with pytest.raises(TierFileError, match=words) as err:
        rf.read(np.array([5, 500]))
    assert "rows.f32" in str(err.value) and "\n" not in str(err.value)


def test_auto_access_maps_a_file_the_memory_holds_and_preads_a_larger_one(tmp_path, monkeypatch):
    from recscale.embedding import row_file

    (tmp_path / "s").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(row_file, "mem_available", lambda: 1 << 30)
    small = _file(tmp_path / "s", 1000, 4)
    monkeypatch.setattr(row_file, "mem_available", lambda: 1000 * 16)  # 2x the file: too big
    big = _file(tmp_path / "b", 1000, 4)
    assert small.access == "map"
    assert big.access == ("pread" if native.library() is not None else "map")
    # two ranks on the host share its memory: a file of 40% of it each is too big
    (tmp_path / "r").mkdir()
    monkeypatch.setattr(row_file, "mem_available", lambda: int(1000 * 16 / 0.4))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = _file(tmp_path / "r", 1000, 4)
    assert shared.access == ("pread" if native.library() is not None else "map")


@pytest.mark.parametrize("fits", [True, False])
def test_a_settled_file_the_memory_holds_keeps_the_runs_writes_off_the_file(
    tmp_path, monkeypatch, fits
):
    """After ``settle`` a mapped file that fits is loaded into memory: reads see every
    write, the file keeps the settled rows (nothing for the kernel to write back mid-run).
    One the memory may not hold stays mapped: its pages remain the kernel's to drop."""
    from recscale.embedding import row_file

    monkeypatch.setattr(row_file, "mem_available", lambda: 1 << 30)
    rf = _file(tmp_path, 1000, 4, access="map")
    first = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    rf.write(np.arange(1000), first)
    if not fits:
        monkeypatch.setattr(row_file, "mem_available", lambda: 1000 * 16)
    rf.settle()
    assert rf.loaded == fits
    assert isinstance(rf.map, np.memmap) != fits  # loaded: process memory, not the map
    rows = np.array([3, 500, 999])
    rf.write(rows, -first[rows])
    want = first.copy()
    want[rows] *= -1
    assert np.array_equal(rf.read(np.arange(1000)), want)
    on_disk = np.frombuffer(os.pread(rf.fd, 1000 * 16, 0), np.float32).reshape(1000, 4)
    assert np.array_equal(on_disk, first if fits else want)
    rf.flush()  # a loaded file's flush writes nothing back
    on_disk = np.frombuffer(os.pread(rf.fd, 1000 * 16, 0), np.float32).reshape(1000, 4)
    assert np.array_equal(on_disk, first if fits else want)


def test_loading_a_file_cut_short_is_an_error_naming_it(tmp_path, monkeypatch):
    from recscale.embedding import row_file

    monkeypatch.setattr(row_file, "mem_available", lambda: 1 << 30)
    rf = _file(tmp_path, 1000, 4, access="map")
    os.ftruncate(rf.fd, 1000 * 16 - 100)
    with pytest.raises(row_file.TierFileError, match=r"read .* while loading it into memory"):
        rf.settle()
    assert not rf.loaded


def test_loaded_files_must_fit_together(tmp_path, monkeypatch):
    """Two files that each fit in half the memory but not together: the first settled
    is loaded into memory, the second stays mapped."""
    from recscale.embedding import row_file

    monkeypatch.setattr(row_file, "mem_available", lambda: 3 * 1000 * 16)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = (_file(tmp_path / d, 1000, 4, access="map") for d in "ab")
    taken = a.settle(0)
    assert taken == 1000 * 16 and a.loaded
    assert b.settle(taken) == 0 and not b.loaded


def test_an_order_of_the_wrong_length_is_refused(tmp_path):
    rf = _file(tmp_path, 10, 2)
    with pytest.raises(ValueError, match="one position per row"):
        rf.set_order(np.arange(9))


def test_file_order_ranks_each_part_within_its_own_rows():
    parts = [
        SimpleNamespace(feature=0, row_lo=0, row_hi=4, table_rows=4),
        SimpleNamespace(feature=1, row_lo=2, row_hi=5, table_rows=6),  # a block of rows
        SimpleNamespace(feature=2, row_lo=0, row_hi=3, table_rows=3),  # id order
    ]
    ranks = {0: np.array([3, 0, 2, 1]), 1: np.array([0, 5, 4, 1, 3, 2]), 2: None}
    pos, segments = file_order(parts, ranks.get)
    assert segments == [(0, 4), (4, 3), (7, 3)]
    # table 1 rows 2..4 have ranks 4, 1, 3 -> 2nd, 0th, 1st of the block
    assert pos.tolist() == [3, 0, 2, 1, 4 + 2, 4 + 0, 4 + 1, 7, 8, 9]
    with pytest.raises(ValueError, match="has 3 ranks, the table 4 rows"):
        file_order(parts[:1], lambda f: np.arange(3))
    assert file_order(parts[2:], ranks.get)[0] is None


def test_synthetic_ranks_invert_the_popularity_law():
    cfg = load_config("debug", [])
    data = make_synthetic(cfg)
    ranks = popularity_ranks(cfg)
    for f in range(3):
        n = cfg.model.table_sizes[f]
        r = ranks(f)
        assert sorted(r.tolist()) == list(range(n))  # a permutation
        ids = torch.cat([data.batch(i, 512).feature_values(f) for i in range(8)]).numpy()
        counts = np.bincount(ids, minlength=n)
        # the ids drawn most are the ones ranked first
        top = np.argsort(-counts, kind="stable")[:5]
        assert r[top].max() < max(10, n // 20)
    by_id = ["--embedding.placement=ssd", "--embedding.row_order=id"]
    assert popularity_ranks(load_config("debug", by_id)) is None


def test_warm_rows_are_the_hottest_of_each_segment_sharing_the_cache(tmp_path):
    n = 1000
    st = CachedStorage(n, 4, SparseSGD(0.1), tmp_path / "t.f32", cache_rows=300)
    rng = np.random.default_rng(1)
    position = np.concatenate([rng.permutation(100), 100 + rng.permutation(900)])
    st.set_row_order(position, [(0, 100), (100, 900)])
    rows = st.warm_rows()
    # 150 each: the small segment keeps its 100, the large takes the 200 left
    want = set(np.flatnonzero(position[:100] < 100)) | set(
        100 + np.flatnonzero(position[100:] - 100 < 200)
    )
    assert set(rows.tolist()) == want and len(rows) == 300
    # hottest first across the segments, the earlier segment first among equal ranks
    rank = position[rows.numpy()] - np.where(rows.numpy() < 100, 0, 100)
    seg = (rows.numpy() >= 100).astype(np.int64)
    assert np.array_equal(np.lexsort((seg, rank)), np.arange(300))
    assert st.warm(rows, pin=120, chunk=37) == 300  # chunks: the same as whole
    pinned_rows = set(st.row_of_slot[st.pinned].tolist())
    assert pinned_rows == set(rows[:120].tolist())
    assert bool((st.slot_of_row[rows] >= 0).all()) and st.free.numel() == 0
    # the hottest warm rows outrank the coldest: the cold ones go first
    first, last = rows[0], rows[-1]
    assert st.score[st.slot_of_row[first]] > st.score[st.slot_of_row[last]]


def test_a_warm_cache_hits_more_than_a_cold_one(tmp_path):
    def hit_rate(warm: bool) -> float:
        over = [
            "--train.steps=10",
            "--train.progress=false",
            "--train.save_model=false",
            "--embedding.placement=ssd",
            "--embedding.cache_bytes=400000",
            f"--embedding.warm_start={str(warm).lower()}",
            f"--embedding.ssd_dir={tmp_path / str(warm)}",
        ]
        return train(load_config("debug", over), None, echo=lambda _m: None)["embedding_cache"][
            "hit_rate"
        ]

    assert hit_rate(True) > hit_rate(False) + 0.05


@pytest.mark.parametrize("warm", [True, False])
def test_the_tier_file_is_on_the_disk_before_step_0(tmp_path, monkeypatch, warm):
    """The initial rows are fdatasync'ed before training (not flushed by the kernel mid-
    run), with or without a warm start, and the run says how long it took."""
    from recscale.embedding import row_file

    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(row_file.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    lines: list[str] = []
    over = [
        "--train.steps=2",
        "--train.progress=false",
        "--train.save_model=false",
        "--embedding.placement=ssd",
        f"--embedding.warm_start={str(warm).lower()}",
        f"--embedding.ssd_dir={tmp_path}",
    ]
    train(load_config("debug", over), None, echo=lines.append)
    assert synced, "no fdatasync of the tier's file"
    assert any("initial rows on the disk" in x for x in lines), lines
    # the debug tables' file is small: loaded into memory for the run, and said so
    assert any("loaded into memory for the run" in x for x in lines), lines


@pytest.mark.parametrize(
    "override, key",
    [
        ("--embedding.io_depth=0", "embedding.io_depth"),
        ("--embedding.io_depth=1000", "embedding.io_depth"),
        ("--embedding.row_order=random", "embedding.row_order"),
        ("--embedding.order_sample_rows=0", "embedding.order_sample_rows"),
        ("--embedding.warm_pin_share=0.99", "embedding.warm_pin_share"),
        ("--embedding.ssd_access=mmap", "embedding.ssd_access"),
    ],
)
def test_bad_io_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("debug", [override])


@needs_native
@pytest.mark.parametrize("direct", [True, False])
def test_the_disk_probe_reads_the_tiers_file_at_depth(monkeypatch, tmp_path, direct):
    """The probe reads 4 KiB blocks of the tier's own file, every one through the batched
    reader (O_DIRECT where the filesystem takes it; else buffered, the file's pages
    dropped), at depth 1 and at the tier's depth; it leaves the file as it was, stops
    after its time limit, and a file too small to probe is an OSError naming it."""
    from recscale.bench import disk

    path = tmp_path / "rows.f32"
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    if direct:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip("this filesystem refuses O_DIRECT")
    else:  # as on tmpfs: O_DIRECT refused at open
        real_open = os.open

        def no_direct(p, flags, *a):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(22, "Invalid argument")
            return real_open(p, flags, *a)

        monkeypatch.setattr(disk.os, "open", no_direct)
    calls = []
    for name in ("row_io", "row_io_direct"):
        real = getattr(disk, name)

        def spy(fd, write, pos, buf, depth, _real=real, _name=name):
            calls.append((_name, write, depth, len(pos)))
            assert (np.diff(pos) > 0).all() and pos.max() < (8 << 20) // 4096
            return _real(fd, write, pos, buf, depth)

        monkeypatch.setattr(disk, name, spy)
    got = disk.measure_file_read_iops(path, depth=8, reads=256)
    assert got["qd1"] > 0 and got["qd8"] > 0 and got["direct"] == float(direct)
    assert got["file_bytes"] == 8 << 20
    used = "row_io_direct" if direct else "row_io"
    assert {c[0] for c in calls} == {used} and not any(c[1] for c in calls)
    assert {c[2] for c in calls} == {1, 8}
    assert sum(c[3] for c in calls) == 64 + 256  # a quarter of the reads at depth 1
    assert path.read_bytes() == data.tobytes()
    calls.clear()
    disk.measure_file_read_iops(path, depth=8, reads=1024, seconds=0.0)
    assert len(calls) == 2  # one chunk a depth: the time was up after each
    (tmp_path / "tiny").write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="tiny"):
        disk.measure_file_read_iops(tmp_path / "tiny", depth=8)


def test_pinned_warm_rows_outlive_any_scan(tmp_path):
    n = 2000
    st = CachedStorage(n, 4, SparseSGD(0.1), tmp_path / "t.f32", cache_rows=200)
    st.set_row_order(np.arange(n), [(0, n)])
    rows = st.warm_rows()
    assert st.warm(rows, pin=150) == 200
    assert int(st.pinned.sum()) == 150
    hot = rows[:150]
    for k in range(20):  # 20 batches of 40 rows never seen before
        ids = torch.arange(200 + 40 * k, 240 + 40 * k)
        st.lookup(ids, torch.arange(ids.numel() + 1), None, for_update=True)
        st.apply_gradients(ids, torch.zeros(ids.numel(), 4))
        st._update_pins.clear()
    assert bool((st.slot_of_row[hot] >= 0).all())  # the kept rows are all still there
    assert st.stats.evictions > 0
    with pytest.raises(CacheTooSmallError, match="warm_pin_share"):
        ids = torch.arange(1000, 1100)  # 100 distinct rows > the 50 unpinned slots
        st.lookup(ids, torch.arange(ids.numel() + 1), None, for_update=True)


@pytest.mark.parametrize(
    "disk_bytes, bounded", [(0, False), (4096 * 10 // 2, False), (4096 * 50, True)]
)
def test_the_io_bound_needs_a_page_a_step_from_the_disk(monkeypatch, tmp_path, disk_bytes, bounded):
    """The printed I/O bound prices the pages the disk served a step at its probed rate;
    under a page a step (the page cache answered the rest) there is no bound to print."""
    from recscale.bench import hardware, throughput
    from recscale.bench.disk import DiskCounters
    from recscale.embedding.cache_stats import CacheStats

    rows = SimpleNamespace(depth=32, access="pread")
    st = SimpleNamespace(
        path=tmp_path / "rows.f32",
        rows=rows,
        stats=CacheStats(),
        cache_stats=lambda: st.stats,
        io_stats=lambda: {
            "rows_read": 800,
            "rows_written": 0,
            "io_requests": 800,
            "io_seconds": 0.1,
        },
    )
    ebc = SimpleNamespace(storages=lambda: [st])
    probed = []

    def probe(path, depth):
        probed.append((path, depth))
        return {"qd1": 1000.0, "qd32": 8000.0, "file_bytes": 3e9, "direct": 1.0}

    st.path.write_bytes(b"")
    monkeypatch.setattr(throughput, "measure_file_read_iops", probe)
    io = throughput.tier_io(ebc, DiskCounters(disk_bytes, 0), steps=10, batch=2048, echo=print)
    line = throughput.format_tier_io(io)
    if bounded:  # 5 pages a step at 8,000 reads/s: 1,600 steps/s of 2048 samples
        assert io["io_bound_samples_per_s"] == pytest.approx(2048 * 8000 / 5)
        assert probed == [(st.path, 32)] and "over the tier's 3.0 GB file (O_DIRECT)" in line
        assert "best reading" not in line  # no record kept in tests: the run's is the best
        # a host that once read such a file faster says so beside the run's own bound
        record = tmp_path / "hardware.json"
        record.write_text('{"disk/qd32/direct/file3GB": 12000.0}')
        monkeypatch.setattr(
            throughput, "best_on_record", lambda k, v: hardware.best_on_record(k, v, record)
        )
        io = throughput.tier_io(ebc, DiskCounters(disk_bytes, 0), steps=10, batch=2048, echo=print)
        line = throughput.format_tier_io(io)
        assert io["io_bound_samples_per_s"] == pytest.approx(2048 * 8000 / 5)
        assert io["io_bound_best_samples_per_s"] == pytest.approx(2048 * 12000 / 5)
        assert "best reading of such a file, 12,000/s: 4,915,200)" in line
    else:  # nothing to bound: the disk is not probed
        assert "io_bound_samples_per_s" not in io and "no I/O bound" in line and not probed
