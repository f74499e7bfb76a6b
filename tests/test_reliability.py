"""Bad input loses nothing and says what is wrong in one line (the first-contact issue):
planted pickles, shared ssd files, reused run directories, bad eval splits, damaged
datasets, SIGTERM, looping manifests, a disk too small for the ssd tier."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import error_line, make_dataset, run_cli

from recscale.checkpoint.format import CheckpointError, manifest_crc
from recscale.checkpoint.manager import checkpoint_dirs, resolve_chain
from recscale.config import ConfigError, load_config
from recscale.embedding.cached_storage import CachedStorage, TierFileError
from recscale.embedding.optimizers import SparseSGD
from recscale.train.run import RunDirInUse, train

QUIET = dict(echo=lambda *_: None)
BASE = ["--train.progress=false", "--data.eval_samples=2048", "--train.steps=20"]
DATASET_BASE = [a for a in BASE if not a.startswith("--data.eval_samples")]  # synthetic's


class _Planted:
    """Unpickling this runs code (it would create the marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


# torch's weights-only loader warns about the planted file's pickle protocol as it refuses it
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_planted_pickle_is_refused_not_run(tmp_path):
    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)
    (ck,) = [d for d in checkpoint_dirs(run / "checkpoints") if d.name.endswith("20")]
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"model": _Planted(str(marker))})
    (ck / "dense.pt").write_bytes(payload)
    manifest = json.loads((ck / "manifest.json").read_text())  # an attacker fixes the CRC too
    manifest["files"]["dense.pt"] = {"bytes": len(payload), "crc32": zlib.crc32(payload)}
    manifest["manifest_crc32"] = manifest_crc(manifest)
    (ck / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("train", "--resume", str(ck), "--run-dir", str(run), "--train.steps=30")
    assert r.returncode == 1 and "refused to load" in error_line(r.stderr)
    r = run_cli("checkpoint", "inspect", str(ck))
    assert r.returncode == 1 and "INVALID" in r.stdout
    r = run_cli("eval", "--model", str(run))
    assert r.returncode == 1 and "refused to load" in error_line(r.stderr)
    assert not marker.exists()


def test_two_runs_cannot_share_an_ssd_file(tmp_path):
    path = tmp_path / "tables_dim8.f32"
    first = CachedStorage(100, 8, SparseSGD(0.1), path, cache_rows=10)
    with pytest.raises(TierFileError, match="in use by another training run"):
        CachedStorage(100, 8, SparseSGD(0.1), path, cache_rows=10)
    assert path.stat().st_size == 100 * 8 * 4  # the first run's file is intact
    del first


def test_the_ssd_file_is_reserved_up_front(tmp_path):
    """A disk too small fails at start with a message (here: a 1 MB file-size limit)."""
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from pathlib import Path
from recscale.embedding.cached_storage import CachedStorage, TierFileError
from recscale.embedding.optimizers import SparseSGD
try:
    CachedStorage(1_000_000, 8, SparseSGD(0.1), Path({str(tmp_path / "t.f32")!r}), cache_rows=10)
except TierFileError as e:
    print(e)
    sys.exit(3)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert "cannot reserve 32.00 MB" in r.stdout and not (tmp_path / "t.f32").exists()


def test_a_run_directory_holding_another_run_is_refused(tmp_path):
    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--checkpoint.every_steps=10"]), run, **QUIET)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(RunDirInUse, match="--resume"):
        train(load_config("debug", [*BASE, "--train.batch_size=128"]), run, **QUIET)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    r = run_cli("train", "--config", "debug", *BASE, "--run-dir", str(run))
    assert r.returncode == 1 and "holds another run" in error_line(r.stderr)
    # resuming the run in its own directory is what the directory is for
    cfg = load_config(str(run / "config.toml"), ["--train.steps=30"])
    assert train(cfg, run, resume=run, **QUIET)["steps"] == 30


@pytest.mark.parametrize("key", ["eval_split", "train_split"])
def test_a_bad_split_fails_before_training_naming_its_key(tmp_path, key):
    """A train split the dataset lacks was a bare dataset error, the key unnamed."""
    ds = make_dataset(tmp_path, 300, seed=1, hash_size=50)
    cfg = load_config("debug", [*BASE, f"--data.path={ds}", f"--data.{key}=nope"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"data.{key}.*no split 'nope'"):
        train(cfg, tmp_path / "run", **QUIET)
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


@pytest.mark.parametrize("damage", ["truncated", "float64", "labels", "tables", "nan"])
def test_a_damaged_dataset_is_named_not_trained(tmp_path, damage):
    ds = make_dataset(tmp_path, 300, seed=2, hash_size=50)
    split = ds / "train"
    if damage == "truncated":
        data = (split / "sparse.i32").read_bytes()
        (split / "sparse.i32").write_bytes(data[: len(data) // 3])
        match = "sparse.i32"
    elif damage == "float64":
        dense = np.fromfile(split / "dense.f32", np.float32)
        dense.astype(np.float64).tofile(split / "dense.f32")
        match = "dense.f32"
    elif damage == "labels":
        labels = np.fromfile(split / "labels.u8", np.uint8)
        labels[7] = 2
        labels.tofile(split / "labels.u8")
        match = "row 7 has label 2"
    elif damage == "nan":
        dense = np.fromfile(split / "dense.f32", np.float32)
        dense[13 * 11 + 4] = np.nan  # row 11
        dense.tofile(split / "dense.f32")
        match = "row 11 has a non-finite dense value"
    else:  # 20 table sizes for 26 columns: once a segfault in the native update
        meta = json.loads((ds / "metadata.json").read_text())
        meta["table_sizes"] = meta["table_sizes"][:20]
        (ds / "metadata.json").write_text(json.dumps(meta))
        match = "20 table sizes for 26"
    r = run_cli(
        "train",
        "--config",
        "debug",
        *DATASET_BASE,
        f"--data.path={ds}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 1, r.stderr
    assert match in error_line(r.stderr)


def test_sigterm_stops_like_ctrl_c(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recscale",
            "train",
            "--config",
            "debug",
            "--train.steps=1000000",
            "--train.log_every=5",
            "--checkpoint.every_steps=1000",
            "--run-dir",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    log = run / "train_log.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (log.exists() and log.stat().st_size > 0):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "SIGTERM" in err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["interrupted"] is True and metrics["steps"] > 0
    chain = resolve_chain(run, echo=lambda _m: None)  # the final checkpoint, resumable
    assert chain[-1].name == f"step_{metrics['steps']:08d}"


def test_a_manifest_whose_parent_is_itself_does_not_loop(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(
        "debug",
        [
            *BASE,
            "--checkpoint.every_steps=10",
            "--checkpoint.full_every=4",
            "--checkpoint.full_if_fraction=1.0",
        ],
    )
    train(cfg, run, **QUIET)
    inc = checkpoint_dirs(run / "checkpoints")[-1]
    assert inc.name.endswith(".inc")
    manifest = json.loads((inc / "manifest.json").read_text())
    manifest["parent"] = inc.name
    manifest["manifest_crc32"] = manifest_crc(manifest)  # a forger recomputes the CRC too
    (inc / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="loops back"):
        resolve_chain(inc)
    messages: list[str] = []
    chain = resolve_chain(run, echo=messages.append)  # falls back to the full one
    assert chain[-1].name == "step_00000010" and "loops back" in messages[0]
    r = run_cli("checkpoint", "inspect", str(run))
    assert r.returncode == 1 and "loops back" in r.stdout


@pytest.mark.parametrize("flag", ["--embedding.optimizer=adam", "--optimizer.name=sgd"])
def test_resume_with_another_optimizer_says_so(tmp_path, flag):
    run = tmp_path / "run"
    train(
        load_config("debug", [*BASE, "--checkpoint.every_steps=10", "--optimizer.name=adam"]),
        run,
        **QUIET,
    )
    r = run_cli("train", "--resume", str(run), flag, "--train.steps=30")
    assert r.returncode == 1
    assert "resume with the" in error_line(r.stderr)


def _synth(tmp_path: Path, name: str = "in.tsv", lines: int = 300) -> Path:
    from recscale.dataprep.criteo_tsv import synthetic_lines

    src = tmp_path / name
    src.write_text("\n".join(synthetic_lines(lines, seed=5)) + "\n")
    return src


@pytest.mark.parametrize("where", ["unrelated", "holds_input", "parent", "cwd"])
def test_preprocess_never_deletes_what_is_not_a_dataset(tmp_path, where, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    src = _synth(work)
    if where == "unrelated":
        out = tmp_path / "photos"
        out.mkdir()
        (out / "keep.jpg").write_bytes(b"precious")
    elif where == "holds_input":
        out = work
    else:
        out = Path("..") if where == "parent" else Path(".")
    r = run_cli(
        "data",
        "preprocess",
        "--input",
        str(src),
        "--out",
        str(out),
        "--split",
        "none",
        "--hash-size",
        "100",
        cwd=work,
    )
    assert r.returncode == 1, r.stderr
    error_line(r.stderr)
    assert src.exists() and work.exists()
    if where == "unrelated":
        assert (out / "keep.jpg").read_bytes() == b"precious"


def test_replacing_a_dataset_keeps_the_old_one_if_the_swap_fails(tmp_path, monkeypatch):
    from recscale.dataprep import preprocess as pp

    src = _synth(tmp_path)

    def opts():
        return pp.PreprocessOptions(
            inputs=[src], out=tmp_path / "ds", split="none", hash_sizes=[100]
        )

    pp.preprocess(opts(), echo=lambda _m: None)
    before = (tmp_path / "ds" / "metadata.json").read_text()
    real = os.replace

    def failing(a, b):
        if str(a).endswith("ds.tmp"):  # the moment between "move aside" and "rename in"
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(pp.os, "replace", failing)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(opts(), echo=lambda _m: None)
    monkeypatch.setattr(pp.os, "replace", real)
    assert (tmp_path / "ds" / "metadata.json").read_text() == before  # whole, the old one
    assert not list(tmp_path.glob(".ds.old-*"))


def test_test_files_need_by_file_and_by_file_needs_a_train_input(tmp_path):
    a, b = _synth(tmp_path, "a.tsv"), _synth(tmp_path, "b.tsv")
    r = run_cli(
        "data",
        "preprocess",
        "--input",
        str(a),
        str(b),
        "--out",
        str(tmp_path / "ds"),
        "--test",
        str(b),
        "--hash-size",
        "100",
    )
    assert r.returncode == 1 and "add --split by-file" in error_line(r.stderr)
    r = run_cli(
        "data",
        "preprocess",
        "--input",
        str(a),
        "--out",
        str(tmp_path / "ds"),
        "--split",
        "by-file",
        "--hash-size",
        "100",
    )
    assert r.returncode == 1 and "no input for training" in error_line(r.stderr)
    assert not (tmp_path / "ds.tmp").exists() and not (tmp_path / "ds").exists()


def test_tables_beyond_memory_fail_in_a_second_naming_the_fixes():
    cfg = load_config("debug", BASE)
    cfg.model.table_sizes = [10**12] + cfg.model.table_sizes[1:]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"embedding.placement.*need [\d,.]+ GB.*placement=auto"):
        train(cfg, None, **QUIET)
    assert time.monotonic() - t0 < 5


def test_epochs_give_the_steps_and_do_not_mix_with_steps(tmp_path):
    ds = make_dataset(tmp_path, 1000, seed=3, hash_size=50)
    cfg = load_config(
        "debug",
        [
            *BASE[:2],
            f"--data.path={ds}",
            "--data.eval_split=train",
            "--train.epochs=2",
            "--train.batch_size=128",
        ],
    )
    m = train(cfg, tmp_path / "run", **QUIET)
    assert m["steps"] == -(-2 * 1000 // 128)  # ceil(2 x rows / batch)
    saved = load_config(str(tmp_path / "run" / "config.toml"))  # reloads: steps recorded
    assert saved.train.steps == m["steps"] and saved.train.epochs == 0
    with pytest.raises(ConfigError, match="both train.steps and train.epochs"):
        load_config("debug", ["--train.steps=10", "--train.epochs=1"])
    for bad in ("-1", "nan"):  # beside train.steps, a bad epochs was dropped unread
        with pytest.raises(ConfigError, match="train.epochs"):
            load_config("debug", ["--train.steps=10", f"--train.epochs={bad}"])
    assert load_config("debug", ["--train.steps=10", "--train.epochs=0"]).train.steps == 10
    with pytest.raises(ConfigError, match="train.epochs.*needs a dataset"):
        train(load_config("debug", ["--train.epochs=1"]), None, **QUIET)


def test_an_empty_manifest_is_invalid_and_resume_falls_back(tmp_path):
    run = tmp_path / "run"
    train(
        load_config("debug", [*BASE, "--checkpoint.every_steps=10", "--checkpoint.full_every=1"]),
        run,
        **QUIET,
    )
    newest = checkpoint_dirs(run / "checkpoints")[-1]
    (newest / "manifest.json").write_text("{}")
    messages: list[str] = []
    chain = resolve_chain(run, echo=messages.append)
    assert chain[-1].name == "step_00000010" and "not a complete manifest" in messages[0]
    r = run_cli("checkpoint", "inspect", str(run))
    assert (
        r.returncode == 1 and "Traceback" not in r.stderr and "not a complete manifest" in r.stdout
    )


def test_default_hash_sizes_fit_the_data(tmp_path):
    src = _synth(tmp_path, lines=500)
    r = run_cli(
        "data", "preprocess", "--input", str(src), "--out", str(tmp_path / "ds"), "--split", "none"
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert max(meta["table_sizes"]) <= 4 * 500 and meta["hash_sizes"] == meta["table_sizes"]


def test_an_ssd_dir_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    r = run_cli(
        "train",
        "--config",
        "debug",
        *BASE,
        "--embedding.placement=ssd",
        f"--embedding.ssd_dir={blocker / 'sub'}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 1 and "ssd_dir" in error_line(r.stderr)


def test_a_failing_final_evaluation_keeps_the_trained_model(tmp_path):
    """An out-of-range id in the test split fails the final evaluation, one line, after
    the trained model (the final checkpoint) is already written."""
    from recscale.dataprep.preprocess import PreprocessOptions, preprocess

    src = _synth(tmp_path, lines=700)
    preprocess(
        PreprocessOptions(inputs=[src], out=tmp_path / "ds", hash_sizes=[100], split="kaggle"),
        echo=lambda _m: None,
    )
    sparse = tmp_path / "ds" / "test" / "sparse.i32"
    ids = np.fromfile(sparse, np.int32)
    ids[5] = 10_000  # table C6 has 100 rows
    ids.tofile(sparse)
    run = tmp_path / "run"
    r = run_cli(
        "train",
        "--config",
        "debug",
        *DATASET_BASE,
        f"--data.path={tmp_path / 'ds'}",
        "--data.eval_split=test",
        "--run-dir",
        str(run),
    )
    assert r.returncode == 1 and "outside its table" in error_line(r.stderr)
    chain = resolve_chain(run, echo=lambda _m: None)
    assert chain[-1].name == "step_00000020"


def test_a_signal_mid_update_ends_the_run_at_that_step_boundary(
    tmp_path, monkeypatch, sigint_handled
):
    """SIGINT arriving inside the sparse update of step 3 (the worst place: tables half
    updated, a thread pool waiting) lets step 3 finish and stops before step 4; the
    rows then equal a run of exactly 3 steps. A second signal stops at once."""
    import torch

    from recscale.embedding.storage import DeviceStorage
    from recscale.train.stop import StopRequest

    calls = []
    original = DeviceStorage.apply_pooled_gradients

    def signalling(self, *args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args)

    base = [*BASE, "--train.steps=50", "--checkpoint.every_steps=1000"]
    monkeypatch.setattr(DeviceStorage, "apply_pooled_gradients", signalling)
    metrics = train(load_config("debug", base), tmp_path / "a", **QUIET)
    monkeypatch.setattr(DeviceStorage, "apply_pooled_gradients", original)
    assert metrics["interrupted"] is True and metrics["stop_signal"] == "SIGINT"
    assert metrics["steps"] == 3 and len(calls) == 3  # one group of tables in debug
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    ref = train(
        load_config("debug", [*BASE, "--train.steps=3", "--checkpoint.every_steps=1000"]),
        tmp_path / "b",
        **QUIET,
    )
    assert ref["steps"] == 3
    from recscale.checkpoint.trainer_files import load_dense

    (got,), (want,) = ((tmp_path / r / "checkpoints").iterdir() for r in ("a", "b"))
    assert got.name == want.name == "step_00000003"
    parts = sorted(p.relative_to(want) for p in (want / "parts").rglob("*") if p.is_file())
    assert parts and parts == sorted(
        p.relative_to(got) for p in (got / "parts").rglob("*") if p.is_file()
    )
    for part in parts:  # every table row and optimizer state, byte for byte
        assert (got / part).read_bytes() == (want / part).read_bytes(), part
    dense_got, dense_want = load_dense(got), load_dense(want)
    for k, v in dense_want["model"].items():
        assert torch.equal(dense_got["model"][k], v), k

    request = StopRequest()
    request.handler(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        request.handler(signal.SIGINT, None)
