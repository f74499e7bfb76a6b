"""The ssd tier: a hot-row cache over a file changes where rows live, never the arithmetic."""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recscale import native
from recscale.config import load_config
from recscale.distributed import DistContext
from recscale.embedding.cached_storage import (
    CachedStorage,
    CacheTooSmallError,
    remove_empty_temp_dirs,
)
from recscale.embedding.optimizers import SparseSGD
from recscale.train.cache_prefetch import CachePrefetcher, prefetch_on_thread
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build
from recscale.train.run import train


def _built(cfg):
    """The model as training builds it (the plan places the tiers), in one process."""
    model, _module, _plan = build(cfg, DistContext(device=torch.device("cpu")), lambda _m: None)
    return model


def _train_tables(
    placement: str, optimizer: str, kernels: str, cache_bytes: int = 0, prefetch: bool = False
):
    cfg = load_config(
        "debug",
        [
            f"--embedding.placement={placement}",
            f"--embedding.optimizer={optimizer}",
            f"--embedding.cache_bytes={cache_bytes}",
            f"--model.kernels={kernels}",
            "--data.max_ids_per_feature=3",
        ],
    )
    model = _built(cfg)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    batches = [data.batch(i, 256) for i in range(12)]
    if prefetch:  # consecutive batches share most hot ids: collisions on every step
        batches = CachePrefetcher(batches, model.embeddings.compute)
    for b in batches:
        loss = F.binary_cross_entropy_with_logits(model(b), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    st = model.embeddings.compute.groups[0].storage
    rows = torch.arange(st.num_rows)
    with torch.no_grad():
        preds = model(data.batch(0, 512, "eval"))
    return st.read_rows(rows), st.read_state(rows), preds, st


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("tier", ["ssd", "host"])
def test_small_cache_trains_exactly_like_memory(optimizer, kernels, tier):
    w0, s0, p0, _ = _train_tables("device", optimizer, kernels)
    # Room for about two batches' distinct rows out of 7,485: constant eviction.
    row_bytes = {"sgd": 32, "rowwise_adagrad": 36, "adam": 96}[optimizer]
    w1, s1, p1, st = _train_tables(tier, optimizer, kernels, cache_bytes=6000 * row_bytes)
    assert st.tier == tier
    assert st.stats.evictions > 0 and st.stats.bytes_written > 0 and st.stats.hit_rate < 1
    assert torch.equal(w0, w1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
    assert torch.equal(p0, p1)
    _assert_slots_consistent(st)


@pytest.mark.skipif(native.library() is None, reason="the native library is not built")
def test_training_pools_from_the_cache_natively_and_updates_without_a_second_probe(
    monkeypatch,
):
    """On the CPU the training lookup of a cached table group runs the native pooled pass
    over the cache's slots (not the storage's torch lookup), and the update takes each
    id's slot from the lookup's pin instead of probing the map again - and training still
    equals training in memory (eviction on every step)."""
    from recscale.embedding import cached_storage

    w0, s0, p0, _ = _train_tables("device", "rowwise_adagrad", "auto")
    torch_lookups, reused = [], []
    real_lookup, real_same = CachedStorage.lookup, cached_storage._same_tensor

    def lookup(self, rows, offsets, psw, for_update=False):
        torch_lookups.append(for_update)
        return real_lookup(self, rows, offsets, psw, for_update)

    def same(a, b):
        reused.append(real_same(a, b))
        return reused[-1]

    monkeypatch.setattr(CachedStorage, "lookup", lookup)
    monkeypatch.setattr(cached_storage, "_same_tensor", same)
    w1, s1, p1, st = _train_tables("ssd", "rowwise_adagrad", "auto", cache_bytes=6000 * 36)
    assert st.stats.evictions > 0
    assert True not in torch_lookups  # evaluation may use it; training never
    assert len(reused) == 12 and all(reused)
    assert torch.equal(w0, w1) and torch.equal(s0["sum"], s1["sum"]) and torch.equal(p0, p1)
    _assert_slots_consistent(st)


def test_prefetch_thread_with_evictions_trains_exactly_like_memory():
    w0, s0, p0, _ = _train_tables("device", "rowwise_adagrad", "auto")
    w1, s1, p1, st = _train_tables(
        "ssd", "rowwise_adagrad", "auto", cache_bytes=5000 * 36, prefetch=True
    )
    assert st.stats.evictions > 0 and st.stats.prefetched > 0
    assert torch.equal(w0, w1) and torch.equal(s0["sum"], s1["sum"]) and torch.equal(p0, p1)
    _assert_slots_consistent(st)


def _assert_slots_consistent(st) -> None:
    """Every slot is free or holds one row, and the two maps invert each other."""
    free = st.free.tolist()
    assert len(set(free)) == len(free), "a slot twice on the free stack"
    assert bool((st.row_of_slot[st.free] == -1).all())
    used = torch.nonzero(st.row_of_slot >= 0).squeeze(1)
    assert used.numel() + len(free) == st.cache_rows
    assert torch.equal(st.slot_of_row[st.row_of_slot[used]].long(), used)
    assert int((st.slot_of_row >= 0).sum()) == used.numel()


def _storage(tmp_path, rows=1000, cache=100, policy="lfu"):
    return CachedStorage(
        rows, 4, SparseSGD(0.1), tmp_path / f"t_{policy}.f32", cache, policy=policy
    )


def _lookup(st, ids):
    rows = torch.tensor(ids, dtype=torch.int64)
    st.lookup(rows, torch.tensor([0, len(ids)]), None, for_update=True)
    st.apply_gradients(rows[:0], torch.zeros(0, 4))  # the update releases the batch's pin
    st._update_pins.clear()


def test_lfu_keeps_hot_rows_through_a_scan_where_lru_does_not(tmp_path):
    rates = {}
    for policy in ("lfu", "lru"):
        st = _storage(tmp_path, rows=5000, cache=100, policy=policy)
        hot, fresh = list(range(40)), iter(range(100, 5000))
        # the hot rows in the first two batches and every 4th after; 30-row scans between
        # (used twice before the cache first fills, they outcount any scanned row: with
        # one use each, LFU could not tell them apart and ties fall either way)
        for step in range(80):
            is_hot = step % 4 == 0 or step == 1
            _lookup(st, hot if is_hot else [next(fresh) for _ in range(30)])
        rates[policy] = st.stats.hit_rate
    assert rates["lfu"] > rates["lru"] + 0.2, rates


def test_cache_too_small_for_a_batch_names_the_key(tmp_path):
    st = _storage(tmp_path, rows=1000, cache=10)
    with pytest.raises(CacheTooSmallError, match="embedding.cache_bytes"):
        st.lookup(torch.arange(50), torch.tensor([0, 50]), None, for_update=True)


def test_reads_and_writes_see_the_cache_and_the_file(tmp_path):
    st = _storage(tmp_path, rows=200, cache=16)
    values = torch.randn(200, 4)
    st.write_rows(torch.arange(200), values)
    rows = torch.tensor([3, 150, 7])
    pooled = st.lookup(rows, torch.tensor([0, 2, 3]), None, for_update=True)
    torch.testing.assert_close(pooled, torch.stack([values[3] + values[150], values[7]]))
    st.apply_gradients(rows, torch.ones(3, 4))  # sgd lr 0.1: rows move by -0.1 in the cache
    expect = values.clone()
    expect[rows] -= 0.1
    assert torch.equal(st.read_rows(torch.arange(200)), expect)
    st.flush()
    assert torch.equal(torch.from_numpy(st.file[:, :4].copy()), expect)


@pytest.mark.parametrize(
    "tier, row_order, warm, prefetch, access",
    [
        ("ssd", "frequency", False, "thread", "auto"),  # cold: the thread brings the rows
        ("ssd", "frequency", False, "inline", "auto"),  # cold: each lookup brings its own
        ("ssd", "frequency", False, "inline", "pread"),  # rows through buffers, not moved
        ("ssd", "frequency", False, "thread", "pread"),  # reads land on the reader thread
        ("ssd", "frequency", False, "thread", "direct"),  # O_DIRECT (pread where refused)
        ("ssd", "frequency", True, "thread", "auto"),
        ("ssd", "id", True, "thread", "auto"),
        ("host", "frequency", True, "thread", "auto"),  # the GPU's host tier: warmed, pinned
        ("host", "frequency", False, "auto", "auto"),
    ],
)
def test_training_with_prefetch_matches_memory_and_reports_the_cache(
    tmp_path, tier, row_order, warm, prefetch, access
):
    over = [
        "--train.steps=60",
        "--train.progress=false",
        "--train.save_model=false",
        "--data.max_ids_per_feature=2",
    ]
    mem = train(load_config("debug", over), None, echo=lambda _m: None)
    lines: list[str] = []
    ssd = train(
        load_config(
            "debug",
            over
            + [
                f"--embedding.placement={tier}",
                "--embedding.cache_bytes=400000",
                f"--embedding.warm_start={str(warm).lower()}",
                f"--embedding.row_order={row_order}",
                f"--embedding.ssd_dir={tmp_path}",
                f"--embedding.cache_prefetch={prefetch}",
                f"--embedding.ssd_access={access}",
            ],
        ),
        None,
        echo=lines.append,
    )
    assert ssd["auc"] == mem["auc"] and ssd["logloss"] == mem["logloss"]
    cache = ssd["embedding_cache"]
    assert cache["bytes_read"] > 0
    said = [s for s in lines if "cache prefetch:" in s]
    assert len(said) == 1, lines
    threaded = "prefetch: a background thread" in said[0]
    if prefetch != "auto":
        assert threaded == (prefetch == "thread")
    if not warm:  # a warm cache may hold every row these steps use
        assert 0 < cache["hit_rate"] < 1
        assert (cache["prefetched"] > 0) == threaded  # inline: the lookups bring misses
    warmed = [s for s in lines if "warm start" in s]
    # id order has no hot head to start from
    assert len(warmed) == (warm and row_order == "frequency")


def test_killed_mid_training_resumes_from_the_checkpoint(tmp_path):
    """The ssd file is scratch: after a SIGKILL (maybe mid write-back) the resumed run
    rewrites every row from the last checkpoint and ends where an uninterrupted one does."""
    from helpers import forked_main, run_cli

    from recscale.distributed.spawn import process_context

    run = tmp_path / "run"
    args = [
        "train",
        "--config",
        "debug",
        "--train.progress=false",
        "--embedding.placement=ssd",
        "--embedding.cache_bytes=400000",
        "--data.max_ids_per_feature=2",
        "--checkpoint.every_steps=20",
        "--checkpoint.async_write=false",
    ]
    # a fork of a server that imported torch: the run to kill starts without that import
    argv = args + ["--train.steps=100000", "--run-dir", str(run)]
    proc = process_context().Process(
        target=forked_main, args=(argv, os.devnull, os.devnull, dict(os.environ), os.getcwd())
    )
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while len(list((run / "checkpoints").glob("step_*"))) < 2:
            assert proc.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert any((run / "embeddings").iterdir())  # the scratch file survived the kill
    steps = ["--train.steps=80", "--data.eval_samples=4096"]
    resumed = run_cli(*args, *steps, "--resume", str(run), "--run-dir", str(tmp_path / "r2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    cfg = load_config(
        "debug",
        ["--train.progress=false", "--data.max_ids_per_feature=2", "--train.save_model=false"]
        + steps,
    )
    whole = train(cfg, None, echo=lambda _m: None)
    line = [x for x in resumed.stdout.splitlines() if x.startswith("eval on")][0]
    assert f"AUC {whole['auc']:.4f}" in line and f"logloss {whole['logloss']:.4f}" in line


def test_auto_placement_moves_big_tables_to_ssd_and_trains_the_same(tmp_path, device):
    over = [
        "--train.steps=30",
        "--train.progress=false",
        "--train.save_model=false",
        "--data.eval_samples=8192",
    ]
    mem = train(load_config("default", over), None, echo=lambda _m: None)
    notes = []
    # default: 667,398 rows x 68 B = 45 MB with row-wise Adagrad state; 40 MB of memory
    auto = train(
        load_config(
            "default",
            over
            + [
                "--embedding.placement=auto",
                "--embedding.memory_budget_gb=0.04",
                f"--embedding.ssd_dir={tmp_path}",
            ],
        ),
        None,
        echo=notes.append,
    )
    # a GPU run's first tier below HBM is host memory; a CPU run's is the ssd file
    tier = "host" if device.type == "cuda" else "ssd"
    assert any(f"tables on {tier}" in n for n in notes), notes
    assert auto["auc"] == mem["auc"] and auto["logloss"] == mem["logloss"]
    assert 0 < auto["embedding_cache"]["table_rows"] < sum(load_config("default").model.table_sizes)


def test_checkpoint_writes_dirty_rows_back_to_the_file(tmp_path):
    from recscale.checkpoint.manager import CheckpointManager
    from recscale.config import CheckpointConfig

    cfg = load_config(
        "debug",
        [
            "--embedding.placement=ssd",
            "--embedding.cache_bytes=400000",
            f"--embedding.ssd_dir={tmp_path / 'ssd'}",
        ],
    )
    model = _built(cfg)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    b = make_synthetic(cfg).batch(0, 256)
    F.binary_cross_entropy_with_logits(model(b), b.labels).backward()
    st = model.embeddings.compute.groups[0].storage
    assert bool(st.cache_dirty.any())
    mgr = CheckpointManager(
        CheckpointConfig(every_steps=1, async_write=False), tmp_path / "ck", model, opt
    )
    mgr.save(1, {"step": 1})
    assert not bool(st.cache_dirty.any())
    rows = torch.arange(st.num_rows)
    on_file = st.file[st.rows.positions(rows.numpy()), : st.dim]  # (rows by frequency)
    assert torch.equal(torch.from_numpy(on_file), st.read_rows(rows))


def test_cache_for_one_batch_but_not_two_stops_prefetching_not_training(tmp_path):
    """A cache that holds a batch but not the next one beside it: the prefetch gives up
    (with a warning) and the lookups bring their own rows in; values stay right."""
    st = _storage(tmp_path, rows=100, cache=10)
    values = torch.randn(100, 4)
    st.write_rows(torch.arange(100), values)
    a, b = torch.arange(0, 8), torch.arange(50, 58)
    st.prefetch(a)
    with pytest.warns(RuntimeWarning, match="prefetching ahead is off"):
        st.prefetch(b)  # 16 distinct rows pinned at once > 10
    for rows in (a, b):
        pooled = st.lookup(rows, torch.tensor([0, 8]), None, for_update=True)
        torch.testing.assert_close(pooled[0], values[rows].sum(0))
        st.apply_pooled_gradients(
            rows, torch.tensor([0, 8]), torch.zeros(8, dtype=torch.int64), None, torch.zeros(1, 4)
        )
    st.prefetch(a)  # off from now on: a no-op, not an error
    assert not st._prefetch_pins


def test_the_temp_ssd_dir_goes_with_the_run_and_a_named_one_stays(tmp_path, monkeypatch):
    """With no ssd_dir and no run dir the tier's file lives in a ``recscale-ssd-*`` temp
    directory that recscale made: it is removed with the last file (49 such empty
    directories had piled up in /tmp). A directory the user named is only emptied."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    over = [
        "--train.steps=5",
        "--train.progress=false",
        "--train.save_model=false",
        "--embedding.placement=ssd",
        "--embedding.cache_bytes=400000",
    ]
    train(load_config("debug", over), None, echo=lambda _m: None)
    gc.collect()
    assert list((tmp_path / "tmp").glob("recscale-ssd-*")) == []
    named = tmp_path / "mine"
    train(load_config("debug", [*over, f"--embedding.ssd_dir={named}"]), None, echo=lambda _m: None)
    gc.collect()
    assert named.is_dir() and list(named.rglob("*.f32")) == []


def test_only_empty_recscale_temp_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    top = tmp_path / "recscale-ssd-abc"
    (top / "rank0").mkdir(parents=True)
    (top / "rank1").mkdir()
    remove_empty_temp_dirs(top / "rank0")  # rank1 is still there: the top stays
    assert not (top / "rank0").exists() and (top / "rank1").is_dir()
    remove_empty_temp_dirs(top / "rank1")
    assert not top.exists()
    other = tmp_path / "user-dir" / "sub"
    other.mkdir(parents=True)
    remove_empty_temp_dirs(other)
    assert other.is_dir()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_pipeline_thread_yields_the_cores_to_the_step():
    """The prefetch pipeline's thread lowers its own priority, never the process's."""
    import threading

    from recscale.distributed.pipeline import BACKGROUND_NICE, lower_thread_priority

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def background():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["lowered"] = lower_thread_priority()
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        seen["expected"] = min(19, before + BACKGROUND_NICE) - before

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen["lowered"] and seen["delta"] == seen["expected"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


@pytest.mark.parametrize("n", [100, 200_000])  # introselect; a sampled cut first
@pytest.mark.parametrize("kind", ["ties", "distinct", "skewed"])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.07, 0.31, 0.99, 1.0, 1.5])
def test_eviction_picks_the_lowest_scores(n, kind, share):
    from recscale.embedding.cache_choice import lowest

    k = int(n * share)
    rng = np.random.default_rng(k + n)
    values = {
        "ties": rng.integers(0, 20, n).astype(np.float64),
        "distinct": rng.random(n),
        # LFU-like: most slots at one count, a long tail above it
        "skewed": np.where(rng.random(n) < 0.8, 1.0, rng.exponential(5, n)),
    }[kind]
    score = torch.from_numpy(values)
    got = lowest(score, k)
    assert got.dtype == torch.int64
    assert got.numel() == min(k, n) and got.unique().numel() == got.numel()
    if 0 < k < n:
        # exactly the k smallest: nothing left behind scores below the largest taken
        taken = score[got].max()
        rest = torch.ones(n, dtype=torch.bool)
        rest[got] = False
        assert bool((score[rest] >= taken).all())
        assert torch.equal(score[got].sort().values, score.sort().values[:k])


def _tiers(*kinds):
    """A stand-in collection whose cached storages are ``kinds``: (device, path, loaded)."""
    storages = [
        SimpleNamespace(
            device=torch.device(dev),
            path=path,
            rows=SimpleNamespace(loaded=loaded or path is None),  # host rows: in memory
            cache_stats=lambda: object(),
        )
        for dev, path, loaded in kinds
    ]
    return SimpleNamespace(storages=lambda: storages)


@pytest.mark.parametrize(
    "kinds, threads, cores, mode, thread",
    [
        ([("cpu", "f", True)], 2, 2, "auto", False),  # a loaded file, every core busy
        ([("cpu", "f", True)], 2, 4, "auto", True),  # a core free for the thread
        ([("cpu", None, False)], 2, 2, "auto", False),  # the host tier on the CPU
        ([("cpu", "f", False)], 2, 2, "auto", True),  # rows wait on the disk
        ([("cpu", "f", True), ("cuda", None, False)], 2, 2, "auto", True),  # a GPU cache
        ([("cpu", "f", True)], 2, 2, "thread", True),
        ([("cpu", "f", False)], 1, 8, "inline", False),
    ],
)
def test_the_prefetch_runs_inline_only_where_a_thread_would_take_the_steps_core(
    kinds, threads, cores, mode, thread
):
    over = ["--embedding.placement=ssd", f"--embedding.cache_prefetch={mode}"]
    cfg = load_config("debug", over).embedding
    on_thread, why = prefetch_on_thread(_tiers(*kinds), cfg, threads, cores)
    assert on_thread == thread and why


def test_a_storage_keeping_rows_in_place_gives_each_row_as_its_slot():
    """RowStorage.slots_for_update's default (no cache): a row is its own slot, on the
    CPU - the cache's override is what moves rows (tests above)."""
    from recscale.embedding.storage import DeviceStorage

    st = DeviceStorage(50, 8, SparseSGD(0.1))
    rows = torch.tensor([3, 49, 3, 0])
    assert st.native_slot_table() is None
    assert torch.equal(st.slots_for_update(rows), rows)


def test_prefetched_reads_land_before_anything_reads_their_rows(tmp_path):
    """Beyond memory (pread access) a prefetch returns once its reads are issued: the
    rows hold their slots at once (a later batch's probe finds them), and the batch's
    lookup, a checkpoint's read and a later batch all see the rows' values - never a slot
    whose data has not landed - however slow the disk."""
    import time

    st = CachedStorage(
        400, 4, SparseSGD(0.1), tmp_path / "t.f32", 100, io_access="pread", io_depth=4
    )
    if not st.reads_land_later():
        pytest.skip("no native library: the file is mapped, reads land at once")
    values = torch.arange(400 * 4, dtype=torch.float32).reshape(400, 4)
    st.write_rows(torch.arange(400), values)
    read = st.rows.read

    def slow_read(rows):
        time.sleep(0.2)
        return read(rows)

    st.rows.read = slow_read
    first = torch.tensor([5, 17, 300, 5, 42])
    second = torch.tensor([17, 99, 300, 7])  # shares rows with the batch in flight
    st.prefetch(first)
    assert bool((st.slot_of_row[first] >= 0).all())  # slots taken before the data lands
    st.prefetch(second)
    assert not st._prefetch_pins[0].landing.done()
    # a checkpoint's read waits for both batches' reads
    assert torch.equal(st.read_rows(torch.tensor([300, 99, 5])), values[[300, 99, 5]])
    for batch in (first, second):
        pooled = st.lookup(batch, torch.tensor([0, len(batch)]), None, for_update=True)
        assert torch.equal(pooled, values[batch].sum(0, keepdim=True))
        st.apply_gradients(batch[:0], torch.zeros(0, 4))
    assert st.stats.read_wait_seconds >= 0.0 and st.stats.lookups == 8


@pytest.mark.parametrize("tier", ["host", "ssd"])
def test_default_caches_of_small_tables_hold_the_batches_in_flight(tmp_path, tier):
    """The debug preset's 7,700 rows: a default host cache of 10% of them held fewer rows
    than one batch of 256 touches, and warm rows pinned to 80% of a cache left less than
    two batches unpinned - both stopped training at the first eviction. A default cache
    holds the batches in flight, and pins leave them room; training matches memory."""
    over = ["--train.steps=20", "--train.progress=false", "--train.save_model=false"]
    mem = train(load_config("debug", over), None, echo=lambda _m: None)
    notes = []
    tiered = train(
        load_config(
            "debug", over + [f"--embedding.placement={tier}", f"--embedding.ssd_dir={tmp_path}"]
        ),
        None,
        echo=notes.append,
    )
    assert tiered["auc"] == mem["auc"] and tiered["logloss"] == mem["logloss"]
    assert any("cache warm start" in n for n in notes), notes


def test_warm_pins_leave_two_batches_of_room(tmp_path):
    st = _storage(tmp_path, rows=1000, cache=300)
    st.set_row_order(None, [(0, 600), (600, 400)])
    assert st.pin_limit(0.8, 10) == 240  # 80% of 300: two batches need 2 x (10 + 10)
    assert st.pin_limit(0.8, 50) == 100  # 300 - 2 x (50 + 50)
    assert st.pin_limit(0.8, 100) == 0  # two batches of 100 ids of each of 2 parts: 400
    st.set_row_order(None, [(0, 990), (990, 10)])
    assert st.pin_limit(0.8, 70) == 300 - 2 * (70 + 10)  # a part is at most whole
    whole = _storage(tmp_path / "whole", rows=300, cache=300)  # never evicts
    assert whole.pin_limit(0.8, 1000) == 240
