"""Command-line values no run can use - a config that is not UTF-8, a number beyond 64
bits, a batch beyond memory, a world of 10^8 ranks, zero timed steps, a parse chunk of 0
bytes, a dataset's metadata from elsewhere: each one line naming the flag, key or file,
before any work (and no traceback, no hang, no silent empty result)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from helpers import error_line, make_dataset

from recscale import native
from recscale.cli.main import main
from recscale.config import ConfigError, load_config
from recscale.data.columns import DatasetError, read_metadata
from recscale.modules.interaction import DotInteraction


def _fails(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and the one error line of ``recscale ARGV`` run in this process."""
    rc = main(list(argv))
    return rc, error_line(capsys.readouterr().err)


def test_a_config_file_that_is_not_utf8_text_is_one_line(tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"\xff\xfe[train]\nsteps = 3\n")
    rc, line = _fails(capsys, "config", "--config", str(bad))
    assert rc == 2 and "not UTF-8" in line and str(bad) in line
    rc, line = _fails(capsys, "config", "--config", str(tmp_path) + "/")
    assert rc == 2 and "is a directory" in line


@pytest.fixture
def alarm():
    """Turns a hang into a failure: SIGALRM after the seconds given raises in the test."""

    def expire(signum, frame):
        raise TimeoutError("still reading after the alarm: a hang, not a refusal")

    old = signal.signal(signal.SIGALRM, expire)
    yield signal.alarm
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "directory"])
@pytest.mark.parametrize(
    "argv, key",
    [
        (["config", "--config", "{}"], "--config"),
        (["config", "--config", "debug", "--distributed.plan={}"], "distributed.plan"),
        (["plan", "--config", "debug", "--calibration", "{}"], "distributed.calibration"),
        (
            ["plan", "--config", "debug", "--device", "h100-sxm", "--device-file", "{}"],
            "--device-file",
        ),
    ],
)
def test_a_named_file_that_is_a_fifo_a_device_or_a_directory_is_refused_unread(
    tmp_path, capsys, alarm, argv, key, what
):
    """A config, plan, calibration or device file read whole would hang on a FIFO (its
    open waits for a writer) and read /dev/zero until the memory is gone."""
    if what == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        kind = "a FIFO"
    elif what == "directory":
        path, kind = tmp_path, "a directory"
    else:
        path, kind = what, "a character device"
    argv = [a.replace("{}", str(path)) for a in argv]
    if argv[0] == "config" and key == "distributed.plan":  # `config` does not read the plan
        argv = ["train", *argv[1:], f"--run-dir={tmp_path / 'run'}"]
    alarm(30)
    rc, line = _fails(capsys, *argv)
    assert rc == 2 and f"'{key}'" in line and f"{path} is {kind}" in line, line


@pytest.mark.parametrize("raw", ["99999999999999999999999", "-9223372036854775809"])
def test_an_integer_beyond_64_bits_names_its_key(raw):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [f"--train.batch_size={raw}"])
    assert e.value.key == "train.batch_size" and "64-bit" in str(e.value)
    with pytest.raises(ConfigError, match="64-bit"):
        load_config("debug", [f"--model.table_sizes=5,{raw}"])


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--world-size", "100000000"], "--world-size"),  # hung in the planner
        (["--world-size", "300"], "--world-size"),  # more ranks than samples (batch 256)
        (["--world-size", "2", "--memory-per-rank", "-1"], "--memory-per-rank"),
        (["--gather-gbps", "0"], "--gather-gbps"),
        (["--ssd-per-rank", "nan"], "--ssd-per-rank"),
        (["--train-samples", "-5"], "--train-samples"),
        (["--device-file", "/nonexistent/devices.toml"], "--device-file"),
        (["--device", "h100-sxm", "--world-size", "100000000"], "--world-size"),
        (["--memory-per-rank", "1e308"], "--memory-per-rank"),  # OverflowError traceback
        (["--host-per-rank", "1e308"], "--host-per-rank"),  # same
        (["--world-size", "2", "--all-to-all-gbps", "5e-324"], "--all-to-all-gbps"),  # nan ms
        (["--gather-gbps", "1e-300"], "--gather-gbps"),  # a 1e297 ms step
        (["--device", "h100-sxm", "--train-samples", "1e308"], "--train-samples"),  # 1e298 h
        (["--train-samples", "0.5"], "--train-samples"),  # "time to train 0 samples"
        (["--device", ""], "--device"),  # was the plan of no device, as if not given
    ],
)
def test_plan_numbers_no_plan_can_use_are_one_line(capsys, argv, flag):
    rc, line = _fails(capsys, "plan", "--config", "debug", *argv)
    assert rc == 2 and f"'{flag}'" in line


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["throughput", "--steps", "0"], "--steps"),  # was a traceback
        (["throughput", "--steps", "-1"], "--steps"),
        (["throughput", "--warmup", "-1"], "--warmup"),
        (["throughput", "--steps", str(2**63)], "--steps"),  # ran silent until killed
        (["throughput", "--warmup", str(10**12)], "--warmup"),
        (["pipeline", "--world-size", "0"], "--world-size"),
        (["pipeline", "--world-size", "1"], "--world-size"),  # a traceback from the rank
        (["calibrate", "--world-size", "1000"], "--world-size"),  # 1000 local processes
        (["calibrate", "--threads", "0"], "--threads"),
        (["calibrate", "--threads", "100000"], "--threads"),
    ],
)
def test_bench_counts_no_benchmark_can_run_with_are_one_line(capsys, argv, flag):
    rc, line = _fails(capsys, "bench", *argv, "--config", "debug")
    assert rc == 2 and f"'{flag}'" in line


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-bad-fraction", "2"], "--max-bad-fraction"),
        (["--max-bad-fraction", "nan"], "--max-bad-fraction"),
        (["--chunk-mb", "0"], "--chunk-mb"),  # parsed nothing and blamed the inputs
        (["--chunk-mb", "-1"], "--chunk-mb"),  # a negative shift: a traceback
        (["--threads", "-1"], "--threads"),
    ],
)
def test_preprocess_settings_out_of_range_are_one_line_and_write_nothing(
    tmp_path, capsys, argv, flag
):
    src = tmp_path / "in.tsv"
    src.write_text("0\t1" + "\t" * 38 + "\n")
    out = tmp_path / "ds"
    rc = main(["data", "preprocess", "--input", str(src), "--out", str(out), *argv])
    line = error_line(capsys.readouterr().err)
    assert rc in (1, 2) and flag in line and not out.exists()


@pytest.mark.parametrize("role", ["--input", "--test"])
@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "/dev/urandom", "directory"])
def test_a_preprocess_input_that_is_a_pipe_a_device_or_a_directory_is_refused(
    tmp_path, capsys, alarm, role, what
):
    """Preprocessing reads an input more than once (ids counted, then parsed) and sizes
    its chunks by the file: a FIFO hung on its open, /dev/zero and /dev/urandom never end."""
    src = tmp_path / "in.tsv"
    src.write_text("0\t1" + "\t" * 38 + "\n")
    if what == "fifo":
        path, kind = tmp_path / "pipe", "a FIFO"
        os.mkfifo(path)
    elif what == "directory":
        path, kind = tmp_path / "days", "a directory"
        path.mkdir()
    else:
        path, kind = what, "a character device"
    files = (
        ["--input", str(path)] if role == "--input" else ["--input", str(src), "--test", str(path)]
    )
    split = "none" if role == "--input" else "by-file"
    out = tmp_path / "ds"
    alarm(30)
    rc, line = _fails(capsys, "data", "preprocess", *files, "--out", str(out), "--split", split)
    assert rc == 1 and f"input {path} is {kind}" in line and not out.exists(), line


@pytest.mark.parametrize("lines", ["0", "-1"])
def test_synth_tsv_of_no_lines_is_one_line(tmp_path, capsys, lines):
    rc, line = _fails(capsys, "data", "synth-tsv", "--lines", lines, "--out", str(tmp_path / "x"))
    assert rc == 1 and "--lines" in line


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("format_version", "x", "format_version"),
        ("format_version", 99, "newer than this recscale reads"),
        ("num_dense", -1, "num_dense"),
        ("table_sizes", [0] * 26, "table_sizes[0]"),
        ("table_sizes", [2**40] * 26, "table_sizes[0]"),  # ids are int32
        ("feature_names", 5, "feature_names"),
        ("feature_names", ["C1"], "feature_names"),
        ("splits", {"train": {"rows": "many"}}, "splits.train.rows"),
        ("splits", {"train": {"rows": 64, "ids": 2.5}}, "splits.train.ids"),
        ("splits", {"../other/train": {"rows": 1}}, "splits.../other/train"),  # outside
        ("splits", {"..": {"rows": 1}}, "not a plain name"),
    ],
)
def test_a_foreign_or_damaged_metadata_field_is_named(tmp_path, field, value, named):
    ds = make_dataset(tmp_path, 64, seed=0, hash_size=50)
    read_metadata(ds)  # as written: accepted
    meta = json.loads((ds / "metadata.json").read_text())
    meta[field] = value
    (ds / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError) as e:
        read_metadata(ds)
    assert named in str(e.value) and "metadata.json" in str(e.value)


@pytest.mark.parametrize("drop", [("splits",), ("num_dense", "table_sizes"), None])
def test_metadata_without_a_datasets_fields_is_named_not_a_key_error(tmp_path, capsys, drop):
    """A metadata.json that parses but lacks what the reader needs (an empty object, a
    hand-trimmed one) is one line naming the missing fields, from training and from
    ``data info`` alike - not a KeyError from deep in the loader."""
    ds = make_dataset(tmp_path, 64, seed=0, hash_size=50)
    meta = json.loads((ds / "metadata.json").read_text())
    meta = {} if drop is None else {k: v for k, v in meta.items() if k not in drop}
    (ds / "metadata.json").write_text(json.dumps(meta))
    missing = drop or ("num_dense", "num_sparse", "table_sizes", "splits")
    for argv in (
        ("data", "info", str(ds)),
        ("train", "--config", "debug", f"--data.path={ds}", "--train.steps=1"),
    ):
        rc, line = _fails(capsys, *argv)
        assert rc == 1 and "metadata.json" in line, line
        assert f"no {', '.join(missing)}" in line, line


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["train", "--config", "", "--train.steps=1"], "--config"),  # trained 'default'
        (["train", "--config", "debug", "--run-dir", ""], "--run-dir"),  # wrote runs/<time>
        (["plan", "--config", " "], "--config"),
        (["bench", "calibrate", "--out", ""], "--out"),  # calibrated a minute, then default
        (["plan", "--config", "debug", "--calibration", ""], "--calibration"),
        (
            ["plan", "--config", "debug", "--device", "h100-sxm", "--device-file", ""],
            "--device-file",
        ),
    ],
)
def test_a_flag_given_an_empty_value_is_refused_not_read_as_left_out(
    tmp_path, capsys, monkeypatch, argv, flag
):
    monkeypatch.chdir(tmp_path)
    rc, line = _fails(capsys, *argv)
    assert rc == 2 and f"'{flag}'" in line and "empty value" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_split_of_a_synthetic_run_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", "--config", "debug", "--train.steps=2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # refused before the model is built and restored (config B: a minute)
    monkeypatch.setattr("recscale.models.dlrm.build_model", lambda *a, **k: pytest.fail("built"))
    rc, line = _fails(capsys, "eval", "--model", str(run), "--split", "nosuch")
    assert rc == 2 and "'--split'" in line and "synthetic" in line
    for empty in ("", " "):  # scored the default split, as if the flag were not given
        rc, line = _fails(capsys, "eval", "--model", str(run), "--split", empty)
        assert rc == 2 and "'--split'" in line and "empty value" in line


def test_bag_sizes_that_are_not_numbers_name_the_flag(tmp_path, capsys):
    ds = make_dataset(tmp_path, 64, seed=0, hash_size=50)
    rc, line = _fails(
        capsys,
        "data",
        "multihot",
        "--input",
        str(ds),
        "--out",
        str(tmp_path / "m"),
        "--bag-sizes",
        "abc",
    )
    assert rc == 1 and "--bag-sizes" in line


def test_a_text_file_given_as_parquet_is_named(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    src = tmp_path / "lines.tsv"
    src.write_text("0\t1" + "\t" * 38 + "\n")
    parquet = "data preprocess --format parquet".split()
    rc = main([*parquet, "--input", str(src), "--out", str(tmp_path / "ds")])
    line = error_line(capsys.readouterr().err)
    assert rc == 1 and str(src) in line and "Parquet" in line


def test_data_info_checks_the_metadata_as_training_does(tmp_path, capsys):
    """`data info` printed any JSON it found and read a FIFO until killed."""
    ds = make_dataset(tmp_path, 64, seed=0, hash_size=50)
    assert main(["data", "info", str(ds)]) == 0
    assert json.loads(capsys.readouterr().out)["num_sparse"] == 26
    meta = json.loads((ds / "metadata.json").read_text())
    (ds / "metadata.json").write_text(json.dumps({**meta, "feature_names": 5}))
    rc, line = _fails(capsys, "data", "info", str(ds))
    assert rc == 1 and "feature_names" in line
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "metadata.json")
    rc, line = _fails(capsys, "data", "info", str(fifo))
    assert rc == 1 and "not a regular file" in line


def test_a_dataset_smaller_than_one_batch_names_the_batch_size(tmp_path, capsys):
    """The loader drops a partial batch, so nothing would train: said before any model is
    built (it had surfaced from the data thread, unnamed)."""
    ds = make_dataset(tmp_path, 100, seed=3, hash_size=50)
    run = tmp_path / "run"
    rc, line = _fails(
        capsys, "train", "--config", "debug", f"--data.path={ds}", "--run-dir", str(run)
    )
    assert rc == 2 and "train.batch_size" in line and "100 rows" in line
    assert not (run / "checkpoints").exists()


def test_an_os_error_of_a_command_is_one_line(tmp_path, capsys):
    """A path the OS refuses (a run directory under a regular file) ends the command
    with one line naming the path, exit 1, no traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, line = _fails(capsys, "train", "--config", "debug", "--run-dir", str(blocker / "run"))
    assert rc == 1 and str(blocker / "run") in line and "Not a directory" in line, line


def test_a_damaged_config_of_a_run_names_the_flag_that_named_the_run(tmp_path, capsys):
    """`train --resume RUN` and `eval --model RUN` read RUN/config.toml: its error names
    the flag the user gave, not --config."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nsteps = [\n")
    rc, line = _fails(capsys, "train", "--resume", str(run))
    assert rc == 2 and "'--resume'" in line and "not valid TOML" in line, line
    rc, line = _fails(capsys, "eval", "--model", str(run))
    assert rc == 2 and "'--model'" in line and "not valid TOML" in line, line


def test_sigterm_during_a_preprocess_removes_its_temporary_dataset(tmp_path, capsys, monkeypatch):
    """SIGTERM (a scheduler's, `timeout`'s) ends any command as Ctrl-C does: the
    preprocess removes OUT.tmp (it was left behind, the process killed outright) and the
    exit code is 143; the handler before the command is back after it."""
    from recscale.dataprep import preprocess as pre

    src = tmp_path / "in.tsv"
    src.write_text("0\t1" + "\t" * 38 + "\n")
    checked = pre.check_bad_lines

    def terminated_here(*a, **kw):  # the OUT.tmp/raw columns are written by now
        assert (tmp_path / "ds.tmp").is_dir()
        os.kill(os.getpid(), signal.SIGTERM)
        return checked(*a, **kw)

    def unhandled(signum, frame):  # what the test sees if the command does not take it
        raise AssertionError("SIGTERM reached the handler from before the command")

    monkeypatch.setattr(pre, "check_bad_lines", terminated_here)
    before = signal.signal(signal.SIGTERM, unhandled)
    out = tmp_path / "ds"
    try:
        rc = main(["data", "preprocess", "--input", str(src), "--out", str(out), "--split", "none"])
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert rc == 143 and "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["in.tsv"]


def test_an_empty_split_to_score_is_named_not_a_traceback(tmp_path, capsys):
    """Seven lines split the Kaggle way leave 'val' with no rows: scoring it was a
    torch.cat traceback after training; now one line naming the key (or eval's split)."""
    from recscale.dataprep.criteo_tsv import synthetic_lines
    from recscale.dataprep.preprocess import PreprocessOptions, preprocess

    src = tmp_path / "in.tsv"
    src.write_text("\n".join(synthetic_lines(7, seed=1)) + "\n")
    ds = tmp_path / "ds"
    preprocess(PreprocessOptions(inputs=[src], out=ds, split="kaggle"), echo=lambda s: None)
    assert read_metadata(ds)["splits"]["val"]["rows"] == 0
    base = ["train", "--config", "debug", f"--data.path={ds}", "--train.batch_size=2"]
    base += ["--train.steps=4", "--train.progress=false"]
    rc, line = _fails(capsys, *base, "--data.eval_split=val", f"--run-dir={tmp_path / 'a'}")
    assert rc == 2 and "'data.eval_split'" in line and "no rows" in line, line
    rc, line = _fails(capsys, *base, "--train.eval_every=2", f"--run-dir={tmp_path / 'b'}")
    assert rc == 2 and "'data.val_split'" in line and "no rows" in line, line
    assert main([*base, f"--run-dir={tmp_path / 'c'}"]) == 0  # the test split has a row
    capsys.readouterr()
    rc, line = _fails(capsys, "eval", "--model", str(tmp_path / "c"), "--split", "val")
    assert rc == 2 and "'--split'" in line and "split 'val'" in line and "no rows" in line, line


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # beyond Python's recursion limit


@pytest.mark.parametrize(
    "argv, key, says",
    [
        (["config", "--config", "{toml}"], "--config", "nests arrays or tables too deeply"),
        (
            ["plan", "--config", "debug", "--device", "h100-sxm", "--device-file", "{toml}"],
            "--device-file",
            "nests arrays or tables too deeply",
        ),
        (
            ["plan", "--config", "debug", "--calibration", "{json}"],
            "distributed.calibration",
            "nested too deeply",
        ),
        (
            ["train", "--config", "debug", "--distributed.plan={json}"],
            "distributed.plan",
            "nested too deeply",
        ),
        (
            ["train", "--config", "debug", "--distributed.plan={list}"],
            "distributed.plan",
            "cannot read a plan",
        ),
        (
            ["train", "--config", "debug", "--distributed.plan={empty_plan}"],
            "distributed.plan",
            "has no placement for tables",
        ),
    ],
)
def test_nested_or_misshapen_files_are_one_line_not_a_recursion_error(
    tmp_path, capsys, argv, key, says
):
    """10^5 nested brackets made tomllib and json raise RecursionError (a traceback); a
    plan file of another shape raised TypeError, one missing tables a ValueError from
    deep in shard(). Each is one line naming the key."""
    files = {
        "toml": "[x]\na = " + DEEP_JSON + "\n",
        "json": DEEP_JSON,
        "list": "[1, 2]",
        "empty_plan": json.dumps(
            {"world_size": 1, "placements": [], "memory_per_rank": [0], "cost_per_rank": [0]}
        ),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [a.format(**{n: tmp_path / n for n in files}) for a in argv]
    if argv[0] == "train":
        argv += ["--train.steps=2", f"--run-dir={tmp_path / 'run'}"]
    rc, line = _fails(capsys, *argv)
    assert rc == 2 and f"'{key}'" in line and says in line, line


def test_deep_json_in_a_dataset_or_a_checkpoint_is_named_or_passed_over(tmp_path, capsys):
    """A dataset's metadata.json nested 10^5 deep is one line; a checkpoint whose manifest
    is, is invalid and resume falls back to the one before."""
    ds = make_dataset(tmp_path, lines=300, seed=0, hash_size=50)
    (ds / "metadata.json").write_text(DEEP_JSON)
    with pytest.raises(DatasetError, match="nested too deeply"):
        read_metadata(ds)
    run = tmp_path / "run"
    base = ["--config", "debug", "--train.progress=false", "--data.eval_samples=512"]
    assert (
        main(["train", *base, "--train.steps=4", "--checkpoint.every_steps=2", f"--run-dir={run}"])
        == 0
    )
    newest = sorted((run / "checkpoints").iterdir())[-1]  # step 4 (incremental)
    (newest / "manifest.json").write_text(DEEP_JSON)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps=6"]) == 0
    out = capsys.readouterr()
    assert "nested too deeply" in out.out + out.err and "Traceback" not in out.err, out
    assert json.loads((run / "metrics.json").read_text())["resumed_from_step"] == 2


def test_a_config_with_a_byte_order_mark_reads_as_without(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    assert load_config(str(path)).train.steps == 3


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("NUMBA_NUM_THREADS", "0", "NUMBA_NUM_THREADS='0': a whole number >= 1"),
        ("NUMBA_NUM_THREADS", "abc", "NUMBA_NUM_THREADS='abc': a whole number >= 1"),
        ("NUMBA_THREADING_LAYER", "bogus", "NUMBA_THREADING_LAYER='bogus': one of workqueue"),
        ("NUMBA_THREADING_LAYER", "tbb", "NUMBA_THREADING_LAYER='tbb': needs Intel TBB"),
    ],
)
def test_numbas_environment_is_one_line_naming_the_variable(tmp_path, name, value, words):
    """NUMBA_NUM_THREADS=0 was a traceback from numba's import, in any command that
    loads the kernels; an unknown threading layer, or tbb without Intel TBB, a traceback
    at the first parallel kernel, mid-run. (A fresh process: numba reads its
    environment once, at import.)"""
    from helpers import cli

    if value == "tbb":
        import importlib.util

        if importlib.util.find_spec("tbb") is not None:
            pytest.skip("Intel TBB is installed here")
    env = dict(os.environ, **{name: value})
    r = cli(
        "train", "--config", "debug", "--train.steps=2", "--run-dir", str(tmp_path / "r"), env=env
    )
    assert r.returncode == 1 and words in error_line(r.stderr)


@pytest.mark.parametrize("value", ["", "2"])
def test_numba_threads_set_empty_or_whole_load_without_a_warning(value):
    """``NUMBA_NUM_THREADS=`` (set empty) printed numba's warning, a traceback in it."""
    import subprocess
    import sys

    code = "from recscale.kernels import numba\nprint(numba.config.NUMBA_NUM_THREADS >= 1)"
    env = dict(os.environ, NUMBA_NUM_THREADS=value)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "True" and r.stderr == "", r.stderr


@pytest.mark.parametrize(
    "override, shown",
    [
        ("--data.eval_split=val", "'val'"),
        ("--data.train_split=val", "'val'"),
        ("--data.val_split=train", "'train'"),
        ("--data.shuffle=false", "false"),
        ("--data.block_rows=128", "128"),
    ],
)
def test_dataset_keys_on_synthetic_data_are_refused(tmp_path, capsys, override, shown):
    """Synthetic data is one stream and one held-out set: these keys changed nothing and
    said nothing (``--data.eval_split=val`` scored the same held-out set). With a
    dataset they apply (the test above); their defaults pass either way."""
    run_dir = tmp_path / "r"
    rc, line = _fails(capsys, "train", "--config", "debug", override, f"--run-dir={run_dir}")
    key = override[2:].split("=")[0]
    assert rc == 2 and f"'{key}': {shown} applies to a dataset (data.path)" in line, line
    assert not run_dir.exists()
    cfg = load_config("debug", ["--data.eval_split=test", "--data.shuffle=true"])
    from recscale.train.data_source import adopt_dataset_shapes

    assert adopt_dataset_shapes(cfg) is None


_needs_native = pytest.mark.skipif(native.library() is None, reason="no native kernels")


@_needs_native
def test_native_kernel_choice_is_explicit_about_what_it_cannot_do():
    inter = DotInteraction(3, 4, True, kernel="native")  # dim 4: not a multiple of 8
    with pytest.raises(ConfigError, match="model.kernels': native: .*multiple of 8"):
        inter(torch.randn(2, 4), torch.randn(2, 12))


@_needs_native
def test_a_kernel_that_cannot_run_is_refused_before_the_run_directory(tmp_path, capsys):
    """model.kernels=native at dim 4 (the interaction kernel needs a multiple of 8) was a
    RuntimeError traceback at the first step, after config.toml was written: the
    directory then held "another run" and no rerun could use it. Now one line naming
    the key, before anything is written."""
    from recscale.cli.main import main

    run = tmp_path / "run"
    narrow = ["--model.embedding_dim=4", "--model.bottom_mlp=32,4", "--train.steps=2"]
    assert (
        main(["train", "--config", "debug", "--model.kernels=native", *narrow, f"--run-dir={run}"])
        == 2
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and "config key 'model.kernels': native:" in err, err
    assert "multiple of 8" in err and not run.exists()
