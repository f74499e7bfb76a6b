"""``recscale bench sweep``: the grid, the CSV, the plots, resuming, bad knobs."""

from __future__ import annotations

import csv
import json
import os
import time

import pytest
from helpers import run_cli

from recscale.bench.sweep import grid, parse_vary, point_overrides
from recscale.config import ConfigError, load_config


def test_grid_is_the_product_and_the_dim_keeps_the_dot_interaction_valid():
    varies = parse_vary(["model.embedding_dim=8,16", "train.batch_size=64,128,256"], "debug")
    points = grid(varies)
    assert len(points) == 6 and points[0] == {"model.embedding_dim": "8", "train.batch_size": "64"}
    over = point_overrides("debug", {"model.embedding_dim": "16"})
    cfg = load_config("debug", over)  # valid: the bottom MLP now ends at 16
    assert cfg.model.bottom_mlp[-1] == 16
    over = point_overrides("debug", {"model.embedding_dim": "1e1"})  # as the loader reads it
    assert load_config("debug", over).model.bottom_mlp[-1] == 10


def test_a_list_valued_knob_keeps_its_commas_inside_brackets():
    """``[32,1],[16,16,1]`` was cut at every comma: '[32' is not an integer."""
    varies = parse_vary(["model.top_mlp=[32,1], [16,16,1]", "model.embedding_dim=8"], "debug")
    assert varies[0] == ("model.top_mlp", ["[32,1]", "[16,16,1]"])
    tops = [load_config("debug", point_overrides("debug", p)).model.top_mlp for p in grid(varies)]
    assert tops == [[32, 1], [16, 16, 1]]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("model.nope=1,2", "model.nope"),
        ("train.batch_size=", "section.key=v1"),
        ("train.batch_size=0,8", "train.batch_size"),
        # the dim's value read for the bottom MLP before the loader saw it: int("a")
        ("model.embedding_dim=16,a", "model.embedding_dim': expected an integer, got 'a'"),
        ("model.top_mlp=[32,1,[16]", r"unbalanced \[ \]"),
        ("model.top_mlp=32,1]", r"unbalanced \[ \]"),
    ],
)
def test_bad_knobs_are_refused_naming_the_key(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_vary([spec], "debug")


def test_sweep_writes_csv_and_plots_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    cmd = [
        "bench",
        "sweep",
        "--vary",
        "model.embedding_dim=8,16",
        "--config",
        "debug",
        "--steps",
        "5",
        "--out",
        str(out),
    ]
    t0 = time.monotonic()
    r = run_cli(*cmd)  # each point runs in a process of its own
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["model.embedding_dim"] for row in rows] == ["8", "16"]
    for row in rows:
        assert not row["error"] and float(row["samples_per_s"]) > 0
        assert float(row["lookup_ms"]) > 0 and float(row["backward_ms"]) > 0
        assert int(row["peak_rss_bytes"]) > 0
    assert list(out.glob("*.png"))
    again = run_cli(*cmd)  # nothing left to run
    assert again.returncode == 0 and "2 of 2 points already" in again.stderr + again.stdout
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2


def test_other_load_counts_other_processes_time_but_not_this_ones(tmp_path, monkeypatch):
    """The arithmetic on /proc's counters, from files written here (a real machine's load
    is whatever else runs on it): busy ticks of all cores minus this process's own,
    over the ticks that passed, times the cores."""
    from recscale.bench import hardware

    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 2)
    stat, own = tmp_path / "stat", tmp_path / "self_stat"

    def write(user, idle, own_user):  # cpu user nice system idle iowait ...
        stat.write_text(f"cpu {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 ...\n")
        own.write_text(f"123 (python (x)) R {' '.join(['0'] * 10)} {own_user} 0 0 0\n")

    write(1000, 1000, 100)
    load = hardware.OtherLoad(str(stat), str(own))
    write(1000 + 150, 1000 + 50, 100 + 50)  # 200 ticks passed: 150 busy, 50 of them ours
    assert load.cores_busy() == pytest.approx((150 - 50) / 200 * 2)
    write(1150 + 100, 1050 + 100, 150 + 100)  # only this process ran
    assert load.cores_busy() == 0.0
    stat.write_text("garbage\n")
    assert load.cores_busy() is None
    assert hardware.OtherLoad().cores_busy() is not None  # the real /proc reads


def test_bound_uses_the_best_reading_this_host_gave(tmp_path):
    """A probe taken in a slow period must not lower the bound below what the hardware
    has shown; a faster probe raises it; no record (``off``) keeps the run's own."""
    from recscale.bench.hardware import best_on_record

    path = tmp_path / "sub" / "hardware.json"
    assert best_on_record("gemm/cpu2/fp32/batch2048", 180.0, path) == 180.0
    assert best_on_record("gemm/cpu2/fp32/batch2048", 120.0, path) == 180.0  # slow period
    assert best_on_record("gemm/cpu2/fp32/batch2048", 200.0, path) == 200.0
    assert best_on_record("gemm/cpu2/fp32/batch512", 90.0, path) == 90.0  # keys apart
    assert json.loads(path.read_text()) == {
        "gemm/cpu2/fp32/batch2048": 200.0,
        "gemm/cpu2/fp32/batch512": 90.0,
    }
    path.write_text("{half a file")  # unreadable: the run's own reading, file rewritten
    assert best_on_record("gemm/cpu2/fp32/batch2048", 150.0, path) == 150.0
    assert json.loads(path.read_text()) == {"gemm/cpu2/fp32/batch2048": 150.0}
    # hand-edited or foreign: not an object, or readings that are not positive finite
    # numbers - each counts as no reading (was an AttributeError or a ValueError)
    for damaged in (
        "[1, 2]",
        '"str"',
        '{"gemm/cpu2/fp32/batch2048": "x"}',
        '{"gemm/cpu2/fp32/batch2048": Infinity}',
        '{"gemm/cpu2/fp32/batch2048": -5, "other": true}',
    ):
        path.write_text(damaged)
        assert best_on_record("gemm/cpu2/fp32/batch2048", 150.0, path) == 150.0, damaged
        assert json.loads(path.read_text())["gemm/cpu2/fp32/batch2048"] == 150.0
    path.write_text('{"gemm/cpu2/fp32/batch2048": 170, "other": 3.5}')  # the rest kept
    assert best_on_record("gemm/cpu2/fp32/batch2048", 150.0, path) == 170.0
    assert best_on_record("disk/qd32", 10.0, path) == 10.0
    assert json.loads(path.read_text()) == {
        "gemm/cpu2/fp32/batch2048": 170.0,
        "other": 3.5,
        "disk/qd32": 10.0,
    }
    path.unlink()
    os.mkfifo(path)  # would hang a plain read
    assert best_on_record("gemm/cpu2/fp32/batch2048", 150.0, path) == 150.0


def test_gemm_probe_is_at_least_as_fast_as_either_library():
    """The probe takes the faster of MKL and oneDNN: a step running its MLP through
    oneDNN must not beat the bound for that reason."""
    from recscale.bench import hardware
    from recscale.modules import gemm

    if gemm.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    calls = []
    real = gemm.ONEDNN_LINEAR

    def counting(*args):
        calls.append(1)
        return real(*args)

    gemm.ONEDNN_LINEAR = counting
    try:
        assert hardware.measure_gemm_gflops(64, repeats=1) > 0
    finally:
        gemm.ONEDNN_LINEAR = real
    assert calls  # oneDNN was timed beside torch.mm


def test_gather_probe_reads_rows_it_has_not_read_before(monkeypatch):
    """Each timed repeat gathers its own random ids: re-reading one id set measures the
    cache after the first pass, and the bound's embedding term came out ~3x too fast."""
    import torch

    from recscale.bench import hardware

    seen: list[torch.Tensor] = []
    real = torch.index_select

    def recording(table, dim, idx, out=None):
        seen.append(idx.clone())
        return real(table, dim, idx, out=out)

    monkeypatch.setattr(torch, "index_select", recording)
    table = torch.randn(1 << 14, 16)
    assert hardware.measure_gather_gbps(table, lookups=1 << 10, repeats=4) > 0
    assert len(seen) == 2 + 4  # warm-up + timed
    distinct = {tuple(idx.tolist()) for idx in seen}
    assert len(distinct) == len(seen)
    assert all(int(idx.min()) >= 0 and int(idx.max()) < table.shape[0] for idx in seen)


def test_native_gather_probe_reads_the_rows_it_is_given():
    """The probe's second gather (the step's own native lookup, one id a bag, the ids cut
    into one feature per thread) returns exactly the rows asked for - so the rate it
    reads is of the bytes the probe counts."""
    import torch

    from recscale import native
    from recscale.bench import hardware

    table = torch.randn(1 << 12, 16)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probe = hardware._native_gather(table, 1001)
        if native.library() is None:
            assert probe is None
            return
        gather, n = probe
        ids = torch.randint(0, table.shape[0], (1001,))
        pooled = gather(ids)[0]
    finally:
        torch.set_num_threads(saved)
    assert n == 1000  # two features of 500 bags
    # sample-major: bag b of feature f is row b * 2 + f
    want = table[ids[:n]].view(2, 500, 16).transpose(0, 1).reshape(-1, 16)
    assert torch.equal(pooled, want)


def test_plots_are_never_written_through_links_planted_at_their_names(tmp_path):
    """``savefig(path)`` wrote through a symbolic link at ``stages.png`` (a shared sweep
    directory, another user): the file it pointed to was overwritten."""
    pytest.importorskip("matplotlib")
    from recscale.bench.sweep import STAGE_COLUMNS, plot

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "sweep"
    out.mkdir()
    names = ["stages.png", "throughput_vs_train_batch_size.png", "heatmap.png"]
    for name in names:
        (out / name).symlink_to(victim)
    rows = [
        {"train.batch_size": b, "train.threads": t, "samples_per_s": 1000.0 * int(b) * int(t)}
        | {f"{s}_ms": 1.0 for s in STAGE_COLUMNS}
        for b in ("64", "128")
        for t in ("1", "2")
    ]
    varies = [("train.batch_size", ["64", "128"]), ("train.threads", ["1", "2"])]
    written = plot(rows, varies, out)
    assert set(names) <= set(written)
    assert victim.read_text() == "keep me"
    for name in names:
        assert not (out / name).is_symlink() and (out / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "precision, per_id",
    [
        ("fp32", 3 * 512 + 8),  # lookup, update read + write; row-wise Adagrad's 4-byte state
        ("fp16", 3 * 256 + 8),
        ("int8", 3 * (128 + 8) + 8),  # codes + scale and bias a row
        ("split_bf16", 256 + 2 * 512 + 8),  # the lookup reads the bf16 high halves only
    ],
)
def test_the_bound_counts_the_bytes_each_row_precision_moves(precision, per_id):
    """Config B (26 one-id features, dim 128): the embedding bytes a sample costs."""
    from recscale.bench.hardware import step_cost
    from recscale.config import load_config

    cfg = load_config("B", [f"--embedding.row_precision={precision}"])
    assert step_cost(cfg, 480, 26.0).embedding_bytes_per_sample == 26 * per_id
