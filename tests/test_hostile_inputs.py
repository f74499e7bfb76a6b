"""Bad values, outputs that would destroy inputs, two writers, full disks: each refused
before anything is lost, in one line naming the key or the path (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import error_line, forked_cli, make_dataset, run_cli

from recscale import locks, native
from recscale.config import ConfigError, load_config
from recscale.config.small_files import write_text_atomic as write_atomic
from recscale.dataprep import common
from recscale.dataprep.multihot import to_multihot
from recscale.train.run import TrainingDiverged, run_lock, train

QUIET = dict(echo=lambda *_: None)
BASE = ["--train.progress=false", "--data.eval_samples=2048", "--train.steps=20"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# -- numbers are checked, not masked ------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["embedding.lr=nan", "embedding.eps=nan", "optimizer.lr=inf", "data.zipf_alpha=-inf"]
)
def test_a_non_finite_setting_names_its_key(key):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [f"--{key}"])
    assert e.value.key == key.split("=")[0] and "finite" in str(e.value)


def test_an_absurd_thread_count_is_refused_not_a_segfault(tmp_path):
    r = run_cli("train", "--config", "debug", "--train.threads=100000", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and "train.threads" in error_line(r.stderr)


def test_more_threads_than_cores_trains_and_says_so(monkeypatch):
    """A thread count the config allows but the host cannot run at once: the run goes
    on (a user may mean it) and says what it costs, naming the key."""
    from recscale.train import step

    monkeypatch.setattr(step, "available_cores", lambda: 2)
    monkeypatch.setattr(step, "local_world_size", lambda: 1)
    cpu = torch.device("cpu")
    assert step.threads_note(2, cpu) is None and step.threads_note(3, torch.device("meta")) is None
    assert "train.threads=3" in step.threads_note(3, cpu) and "2 cores" in step.threads_note(3, cpu)
    monkeypatch.setattr(step, "local_world_size", lambda: 2)
    assert step.threads_note(1, cpu) is None
    assert "x 2 ranks" in step.threads_note(2, cpu)
    monkeypatch.setattr(step, "local_world_size", lambda: 1)
    lines: list[str] = []
    cfg = load_config("debug", [*BASE, "--train.steps=2", "--train.threads=3"])
    train(cfg, None, echo=lines.append)
    assert any("train.threads=3 is more threads than the 2 cores" in x for x in lines)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_divergence_stops_the_run_naming_the_step_on_every_kernel_path(kernels):
    """A learning rate of 1e38 overflows the tables: NaN rows whose NaN a fused ReLU
    (oneDNN's, ours before) mapped to 0 - the run said AUC 0.5 and exited 0."""
    cfg = load_config("debug", [*BASE, "--embedding.lr=1e38", f"--model.kernels={kernels}"])
    with pytest.raises(TrainingDiverged, match=r"at step \d+"):
        train(cfg, None, **QUIET)


def test_the_native_relu_passes_nan_through_as_torch_does():
    if not native.has_avx512():
        pytest.skip("the native narrow forward runs on AVX-512 only")
    from recscale.modules import gemm

    x = torch.randn(64, 13)
    x[5, 3] = float("nan")
    w, b = torch.randn(512, 13), torch.randn(512)
    got = gemm.narrow_forward(x, w, b, relu=True)  # native/narrow_layer.c
    want = torch.relu(x @ w.t() + b)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[5]).all())


# -- nothing is overwritten before the new thing is complete --------------------------------


def test_preprocess_into_a_directory_that_is_also_something_else_is_refused(tmp_path):
    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    (ds / "notes.txt").write_text("mine")
    before = _tree(ds)
    src = tmp_path / "in.tsv"
    r = run_cli("data", "preprocess", "--input", str(src), "--out", str(ds), "--split", "none")
    assert r.returncode != 0 and "notes.txt" in error_line(r.stderr)
    assert _tree(ds) == before


def test_multihot_onto_its_own_input_is_refused(tmp_path):
    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    before = _tree(ds)
    r = run_cli("data", "multihot", "--input", str(ds), "--out", str(ds), "--bag-sizes", "2")
    assert r.returncode != 0 and "input" in error_line(r.stderr)
    assert _tree(ds) == before


def test_a_failed_resume_leaves_the_runs_config_as_it_was(tmp_path):
    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)
    config = (run / "config.toml").read_bytes()
    r = run_cli("train", "--resume", str(run), "--embedding.optimizer=adam", "--train.steps=30")
    assert r.returncode == 1
    assert (run / "config.toml").read_bytes() == config
    r = run_cli("train", "--resume", str(run), "--train.steps=30")
    assert r.returncode == 0, r.stderr


def test_an_atomic_write_that_fails_leaves_neither_half_a_file_nor_its_temp(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    target.write_text("old")

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="metrics.json"):
        write_atomic(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_links_planted_in_a_run_directory_are_never_written_through(tmp_path):
    """A symbolic link at a name a run writes (a shared /tmp, another user): the train log
    is refused naming it, eval's metrics and the atomic writes replace the link; the file
    it points to is never touched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").symlink_to(victim)
    r = run_cli("train", "--config", "debug", "--train.steps=3", f"--run-dir={run}")
    assert r.returncode == 1 and "train_log.jsonl: a symbolic link; refused" in r.stderr
    assert victim.read_text() == "precious"

    run = tmp_path / "run2"  # the refused run left its config.toml: a run of its own
    assert (
        run_cli("train", "--config", "debug", "--train.steps=3", f"--run-dir={run}").returncode == 0
    )
    (run / "eval_synthetic-eval.json").symlink_to(victim)
    r = run_cli("eval", "--model", str(run))
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious"
    assert not (run / "eval_synthetic-eval.json").is_symlink()
    assert json.loads((run / "eval_synthetic-eval.json").read_text())["count"] > 0

    link = tmp_path / "metrics.json"
    link.symlink_to(victim)
    write_atomic(link, "new")
    assert victim.read_text() == "precious" and link.read_text() == "new"
    assert not link.is_symlink()


def test_synth_tsv_never_writes_through_links_at_its_names(tmp_path):
    from recscale.dataprep.criteo_tsv import write_tsv

    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "s.tsv"
    for name in ("s.tsv.partial", "s.tsv.optimum.json", "s.tsv"):
        (tmp_path / name).symlink_to(victim)
    write_tsv(out, 500, block=200)
    assert victim.read_text() == "precious"
    assert len(out.read_text().splitlines()) == 500 and not out.is_symlink()
    assert not (tmp_path / "s.tsv.partial").exists()


def test_a_preprocess_that_fails_midway_removes_its_temporary_dataset(tmp_path, monkeypatch):
    from recscale.dataprep import preprocess as pp

    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    before = _tree(ds)

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pp.IdCounts, "add", full_disk)  # after pass 1 wrote OUT.tmp/raw
    opts = pp.PreprocessOptions(
        inputs=[tmp_path / "in.tsv"], out=ds, hash_sizes=[100], split="none"
    )
    with pytest.raises(OSError):
        pp.preprocess(opts, echo=lambda _m: None)
    assert not (tmp_path / "ds.tmp").exists() and _tree(ds) == before


def test_multihot_says_what_it_will_write_and_refuses_what_does_not_fit(tmp_path, monkeypatch):
    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    said: list[str] = []
    real = common.shutil.disk_usage
    monkeypatch.setattr(common.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OSError, match="needs 2.10 MB but .* has 1.00 kB free"):
        to_multihot(ds, tmp_path / "mh", [100], layout="ids", echo=said.append)
    assert any("writing" in s for s in said)
    assert not (tmp_path / "mh").exists() and not (tmp_path / "mh.tmp").exists()


# -- one writer ---------------------------------------------------------------------------


def test_a_second_writer_of_a_run_directory_is_told_who_holds_it(tmp_path):
    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)
    locks.hold(run_lock(run), "test")  # as a first `--resume` still running would
    try:
        r = forked_cli("train", "--resume", str(run), "--train.steps=30")  # another process
        assert r.returncode == 1 and f"pid {os.getpid()}" in error_line(r.stderr)
    finally:
        locks.release(run_lock(run))
    assert run_cli("train", "--resume", str(run), "--train.steps=30").returncode == 0


def test_a_second_writer_of_a_dataset_is_told_who_holds_it(tmp_path):
    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    lock = tmp_path / ".mh.lock"
    locks.hold(lock, "test")
    try:
        r = forked_cli("data", "multihot", "--input", str(ds), "--out", str(tmp_path / "mh"))
        assert r.returncode == 1 and f"pid {os.getpid()}" in error_line(r.stderr)
    finally:
        locks.release(lock)


# -- calibration files --------------------------------------------------------------------


def _damaged_cache(tmp_path: Path) -> dict:
    cache = tmp_path / "cache" / "recscale"
    cache.mkdir(parents=True)
    import platform

    bad = {
        "format": 3,
        "machine": "x",
        "threads": 2,
        "laws": {"lookup": {"features": ["a"], "coef": ["zz"]}},
    }
    (cache / f"calibration-{platform.node() or 'host'}.json").write_text(json.dumps(bad))
    return dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))


def test_a_damaged_default_calibration_is_ignored_and_a_named_one_is_one_line(tmp_path):
    env = _damaged_cache(tmp_path)
    r = run_cli("plan", "--config", "debug", "--world-size", "2", env=env)
    assert r.returncode == 0, r.stderr
    bad = next((tmp_path / "cache" / "recscale").iterdir())
    r = run_cli(
        "plan",
        "--config",
        "debug",
        "--world-size",
        "2",
        f"--distributed.calibration={bad}",
        env=env,
    )
    assert r.returncode == 2 and "distributed.calibration" in error_line(r.stderr)


def test_every_rank_plans_beside_a_damaged_default_calibration(tmp_path, monkeypatch):
    """What each torchrun rank asks before planning (``train.parallel._shared_laws``):
    a damaged default calibration reads as none (it crashed rank 0 alone, and the other
    ranks waited), a damaged named one is a config error every rank raises."""
    from recscale.distributed import DistContext
    from recscale.train.parallel import _shared_laws

    env = _damaged_cache(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    cfg = load_config("debug", ["--distributed.sharding=auto"])
    assert _shared_laws(cfg, DistContext()) is None
    cfg.distributed.calibration = str(next((tmp_path / "cache" / "recscale").iterdir()))
    with pytest.raises(ConfigError, match="not a calibration"):
        _shared_laws(cfg, DistContext())


def test_the_cache_dir_follows_an_absolute_xdg_cache_home_only(tmp_path, monkeypatch):
    """XDG_CACHE_HOME set empty or relative put the host's calibration and probe records
    under whatever directory a command ran from (``./recscale/hardware-HOST.json``). The
    XDG rule: only an absolute path counts; otherwise ~/.cache."""
    from recscale.bench.hardware import record_path
    from recscale.config.small_files import user_cache_dir
    from recscale.perfmodel.calibration import default_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RECSCALE_HARDWARE_RECORD")  # the tests' "off": the default path
    home = tmp_path / "home" / ".cache" / "recscale"
    for value in ("", "relative/cache", "."):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert user_cache_dir() == home
        assert record_path().parent == default_path().parent == home
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_path().parent == tmp_path / "xdg" / "recscale"


def test_a_named_calibration_one_rank_does_not_use_is_still_checked(tmp_path, capsys):
    """One rank plans without costs, so a named calibration was never opened: a typo
    (or a damaged file) trained without a word and failed on the first multi-rank run."""
    from recscale.cli.main import main

    for bad in (tmp_path / "nosuch.json", tmp_path / "empty.json"):
        if bad.name == "empty.json":
            bad.write_text("{}")
        argv = ["train", "--config", "debug", "--train.steps=1", f"--run-dir={tmp_path / 'r'}"]
        assert main([*argv, f"--distributed.calibration={bad}"]) == 2
        assert "'distributed.calibration'" in capsys.readouterr().err
        assert not (tmp_path / "r").exists()


def test_a_dataset_that_fills_the_disk_names_where_and_leaves_nothing(tmp_path, monkeypatch):
    """A preprocess whose first pass fills the disk said only "No space left on device"
    (a write's error names no file): it names the disk and the dataset now, and leaves
    neither the dataset nor ``OUT.tmp``."""
    from recscale.dataprep import preprocess as pp
    from recscale.dataprep.criteo_tsv import synthetic_lines

    src = tmp_path / "in.tsv"
    src.write_text("\n".join(synthetic_lines(300, seed=3)) + "\n")

    def full(self, piece):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pp._RawColumns, "append", full)
    out = tmp_path / "ds"
    with pytest.raises(OSError) as err:
        pp.preprocess(pp.PreprocessOptions(inputs=[src], out=out), echo=lambda s: None)
    msg = str(err.value)
    assert f"the disk under {tmp_path} (" in msg and f"filled while {out} was written" in msg
    assert "nothing was written" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.tsv"]


def test_a_checkpoint_that_hits_a_full_disk_leaves_no_temporary_directory(tmp_path, monkeypatch):
    from recscale.checkpoint import format as fmt

    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)
    real = fmt.CheckpointWriter.write_chunks

    def full_disk(self, name, chunks):
        if name.endswith(".f32"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, chunks)

    monkeypatch.setattr(fmt.CheckpointWriter, "write_chunks", full_disk)
    with pytest.raises(fmt.CheckpointError, match="No space left") as err:
        train(load_config("debug", [*BASE, "--train.steps=30"]), run, resume=run, **QUIET)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["step_00000010", "step_00000020"]  # no .step_*.tmp-*, the good ones kept
    # the message names the checkpoint, the room left there and the one kept (it had said
    # only "writing a checkpoint failed: [Errno 28] No space left on device")
    msg = str(err.value)
    assert str(run / "checkpoints" / "step_00000030") in msg, msg
    assert re.search(r"\(\d[\d,]*\.\d\d [kMG]?B free there\)", msg), msg
    assert "the newest good one, step_00000020, is kept" in msg, msg


def _criteo_parquet_columns(pa, labels=(0, 1)):
    cols = {"label": pa.array(list(labels))}
    cols |= {f"I{k}": pa.array([1] * len(labels)) for k in range(1, 14)}
    cols |= {f"C{k}": pa.array(["0a"] * len(labels)) for k in range(1, 27)}
    return cols


@pytest.mark.parametrize("damage", ["missing_column", "string_labels", "column_twice"])
def test_damaged_parquet_is_one_line_naming_the_file_and_column(tmp_path, damage):
    """A column twice (``C7`` and ``C7``) was pyarrow's KeyError traceback."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = _criteo_parquet_columns(pa)
    if damage == "missing_column":
        del cols["C7"]
    elif damage == "string_labels":
        cols["label"] = pa.array(["yes", "no"])
    src = tmp_path / "in.parquet"
    table = pa.table(cols)
    if damage == "column_twice":
        table = table.append_column("C7", pa.array(["0b", "1c"]))
    pq.write_table(table, src)
    r = run_cli(
        "data",
        "preprocess",
        "--format",
        "parquet",
        "--input",
        str(src),
        "--out",
        str(tmp_path / "ds"),
        "--split",
        "none",
    )
    line = error_line(r.stderr)
    assert r.returncode == 1 and str(src) in line, r.stderr
    assert ("'label'" if damage == "string_labels" else "'C7'") in line
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.tmp").exists()


def test_parquet_labels_that_are_not_0_or_1_are_counted_bad(tmp_path):
    """A label of 0.5 (a probability, a soft label) was truncated to 0 and trained on."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table(_criteo_parquet_columns(pa, [0.0, 1.0, 0.5, 0.99, -0.0, 1.0])), src)
    out = tmp_path / "ds"
    r = run_cli(
        "data", "preprocess", "--format", "parquet", "--input", str(src), "--out", str(out),
        "--split", "none", "--max-bad-fraction", "0.5",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["bad_lines"]["counts"] == {"bad label": 2}
    assert meta["bad_lines"]["examples"]["bad label"] == [f"{src}:3", f"{src}:4"]
    assert meta["splits"]["train"]["rows"] == 4


@pytest.mark.parametrize("damage", ["lengths", "offsets"])
def test_damaged_multi_hot_bags_are_named_at_open_not_misread(tmp_path, damage):
    import numpy as np

    from recscale.data.dataset import BinaryDataset, DatasetError

    ds = make_dataset(tmp_path, lines=300, seed=1, hash_size=100)
    mh = tmp_path / "mh"
    to_multihot(ds, mh, [2], layout="ids", echo=lambda _m: None)
    if damage == "lengths":
        f = np.memmap(mh / "train" / "bag_lengths.u16", np.uint16, "r+")
        f[7 * 26 + 3] += 1  # row 7, feature C4: one id more than the offsets give it
        f.flush()
        match = "row 7's bag lengths"
    else:
        f = np.memmap(mh / "train" / "row_offsets.i64", np.int64, "r+")
        f[-1] += 5
        f.flush()
        match = "runs from 0 to"
    del f
    with pytest.raises(DatasetError, match=match):
        BinaryDataset(mh, "train")


def test_a_second_signal_inside_a_checkpoint_write_gives_its_reason(tmp_path, monkeypatch):
    from recscale.checkpoint import manager as mgr

    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt  # what the second SIGTERM raises mid-write

    monkeypatch.setattr(mgr, "write_part", interrupted)
    cfg = load_config("debug", [*BASE, "--train.steps=30", "--checkpoint.async_write=false"])
    with pytest.raises(mgr.CheckpointError, match="interrupted by a second stop signal"):
        train(cfg, run, resume=run, **QUIET)
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_a_fifo_for_a_datasets_metadata_is_refused_not_read(tmp_path):
    from recscale.data.dataset import BinaryDataset, DatasetError

    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    (ds / "metadata.json").unlink()
    os.mkfifo(ds / "metadata.json")
    with pytest.raises(DatasetError, match="not a regular file"):
        BinaryDataset(ds, "train")


def test_a_dataset_column_that_is_a_symlink_is_refused(tmp_path):
    from recscale.data.dataset import BinaryDataset, DatasetError

    ds = make_dataset(tmp_path, lines=200, seed=1, hash_size=100)
    col = ds / "train" / "labels.u8"
    outside = tmp_path / "elsewhere.u8"
    outside.write_bytes(col.read_bytes())  # the right size: only the link is wrong
    col.unlink()
    col.symlink_to(outside)
    with pytest.raises(DatasetError, match="symbolic link"):
        BinaryDataset(ds, "train")


def test_a_run_directory_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = run_cli(
        "train", "--config", "debug", "--train.steps=3", "--run-dir", str(tmp_path / "afile")
    )
    assert r.returncode == 1 and "is a file" in error_line(r.stderr)


def test_an_atomic_write_makes_its_file_as_open_would_under_the_umask(tmp_path):
    """The temporary file (0600 as created) gets the mode open() would give: 0644 under
    umask 022, 0600 under 077."""
    import stat

    old = os.umask(0o022)
    try:
        for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
            os.umask(umask)
            write_atomic(tmp_path / f"m{umask:o}.json", "{}")
            assert stat.S_IMODE((tmp_path / f"m{umask:o}.json").stat().st_mode) == mode
    finally:
        os.umask(old)


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_over_a_megabyte_mid_file_is_one_bad_line_not_the_files_end(tmp_path, gz):
    """A run of zeros a crash left (or lines run together) 1 MB past whole lines ended
    the whole file: "no line break in ... not a Criteo TSV file". It is one bad line,
    read through without being held, and the lines after it count on."""
    import gzip

    from recscale.dataprep.criteo_tsv import synthetic_lines

    good = synthetic_lines(20, seed=5)
    text = "\n".join(good[:10]) + "\n1\t" + "\0" * (3 << 20) + "\n"
    text += "\n".join([*good[10:13], "7" + good[13][1:], *good[14:]]) + "\n" + "x" * (3 << 20)
    src = tmp_path / ("in.tsv.gz" if gz else "in.tsv")
    src.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    out = tmp_path / "ds"
    r = run_cli(
        "data", "preprocess", "--input", str(src), "--out", str(out), "--split", "none",
        "--max-bad-fraction", "0.5", "--chunk-mb", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "metadata.json").read_text())["bad_lines"]
    assert report["lines"] == 22 and report["bad"] == 3  # 19 good, the zeros, 7, the xs
    assert report["examples"]["bad label"] == [f"{src}:15"]
    # a decompressed block can hold all the zeros: then the parser sees the line whole
    assert report["examples"]["line over 1 MB"][-1] == f"{src}:22"
    long = [*report["examples"]["line over 1 MB"], *report["examples"].get("wrong field count", [])]
    assert sorted(long) == [f"{src}:11", f"{src}:22"]
    assert json.loads((out / "metadata.json").read_text())["splits"]["train"]["rows"] == 19
