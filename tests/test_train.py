"""End-to-end training runs on the debug preset (each a few seconds on 2 cores)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recscale.config import load_config
from recscale.data.synthetic import SyntheticCriteo
from recscale.modules.id_checks import IdOutOfRangeError
from recscale.train.run import TrainingDiverged, train


def _quiet(*_):
    pass


def test_debug_run_learns_and_writes_run_dir(tmp_path):
    cfg = load_config("debug", ["--train.progress=false"])
    metrics = train(cfg, tmp_path, echo=_quiet)
    assert metrics["auc"] >= 0.70, metrics
    assert metrics["ne"] < 1.0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("auc", "logloss", "ne", "samples_per_s", "steps", "calibration"):
        assert key in saved
    assert saved["steps"] == cfg.train.steps and saved["interrupted"] is False
    assert load_config(str(tmp_path / "config.toml")) == cfg
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == cfg.train.steps


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_other_sparse_optimizers_train(tmp_path, optimizer):
    lr = {"sgd": 0.5, "adam": 0.01}[optimizer]
    cfg = load_config(
        "debug",
        ["--train.progress=false", f"--embedding.optimizer={optimizer}", f"--embedding.lr={lr}"],
    )
    assert train(cfg, None, echo=_quiet)["auc"] >= 0.70


def test_multi_hot_mean_pooling_trains():
    cfg = load_config(
        "debug",
        [
            "--train.progress=false",
            "--model.pooling=mean",
            "--data.min_ids_per_feature=0",
            "--data.max_ids_per_feature=3",
        ],
    )
    assert train(cfg, None, echo=_quiet)["auc"] >= 0.70


def test_same_config_same_result():
    cfg = load_config(
        "debug", ["--train.progress=false", "--train.steps=30", "--data.eval_samples=2048"]
    )
    a, b = train(cfg, None, echo=_quiet), train(cfg, None, echo=_quiet)
    assert a["logloss"] == b["logloss"] and a["auc"] == b["auc"]


def test_nan_loss_stops_naming_the_step():
    cfg = load_config(
        "debug", ["--train.progress=false", "--optimizer.name=sgd", "--optimizer.lr=1e30"]
    )
    with pytest.raises(TrainingDiverged, match=r"at step \d+"):
        train(cfg, None, echo=_quiet)


def test_out_of_range_id_names_feature(monkeypatch):
    original = SyntheticCriteo.batch

    def corrupt(self, index, batch_size, split="train"):
        batch = original(self, index, batch_size, split)
        if index == 3 and split == "train":
            b = batch.batch_size
            start = int(batch.offsets[4 * b])  # first id of feature C5 (table of 1000 rows)
            batch.values[start] = 1_000_000
        return batch

    monkeypatch.setattr(SyntheticCriteo, "batch", corrupt)
    cfg = load_config("debug", ["--train.progress=false"])
    with pytest.raises(IdOutOfRangeError, match=r"id 1000000 of feature C5"):
        train(cfg, None, echo=_quiet)


@pytest.mark.parametrize(
    "storage",
    [
        [],  # fp32 rows, dim 8: torch's lookup
        ["--model.embedding_dim=16", "--model.bottom_mlp=[32,16]"],  # the native lookup
        ["--embedding.row_precision=int8"],
        ["--embedding.row_precision=fp16"],
        ["--embedding.compression=qr", "--embedding.compress_min_rows=10"],
        ["--embedding.placement=ssd", "--embedding.cache_bytes=200000"],
        ["--train.precision=bf16"],
    ],
    ids=["fp32", "native", "int8", "fp16", "qr", "ssd", "bf16"],
)
def test_unchecked_ids_past_every_table_still_stop_the_step(monkeypatch, tmp_path, storage):
    """``embedding.validate_ids=false`` skips the per-feature check, not memory safety:
    an id past all of a storage's rows stops the step - never a read or write outside
    the rows - and the failed lookup is explained as the check would have (torch's
    "Expected i < index_size" named nothing; schema.py's comment says what the switch
    does give up)."""
    original = SyntheticCriteo.batch

    def corrupt(self, index, batch_size, split="train"):
        batch = original(self, index, batch_size, split)
        if index == 2 and split == "train":
            batch.values[-1] = 1 << 40  # the last feature's last id, past every row
        return batch

    monkeypatch.setattr(SyntheticCriteo, "batch", corrupt)
    overrides = ["--train.progress=false", "--embedding.validate_ids=false", "--train.steps=4"]
    overrides += ["--data.prefetch_batches=0", *storage]
    if "--embedding.placement=ssd" in storage:
        overrides.append(f"--embedding.ssd_dir={tmp_path}")
    cfg = load_config("debug", overrides)
    with pytest.raises(IdOutOfRangeError, match=r"id 1099511627776 of feature C26 .*is off"):
        train(cfg, None, echo=_quiet)


def _interrupt_at(monkeypatch, step_index: int):
    """Make the synthetic stream raise KeyboardInterrupt at a training batch (like Ctrl-C)."""
    original = SyntheticCriteo.batch

    def interrupt(self, index, batch_size, split="train"):
        if index == step_index and split == "train":
            raise KeyboardInterrupt
        return original(self, index, batch_size, split)

    monkeypatch.setattr(SyntheticCriteo, "batch", interrupt)
    return original


def test_interrupt_still_writes_metrics(tmp_path, monkeypatch):
    _interrupt_at(monkeypatch, 12)
    cfg = load_config("debug", ["--train.progress=false", "--data.prefetch_batches=0"])
    metrics = train(cfg, tmp_path, echo=_quiet)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["interrupted"] and saved["interrupted"] and saved["steps"] == 12
    assert saved["auc"] is None and math.isfinite(saved["train_loss"])


def test_sigint_to_cli_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
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
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A test runner started in the background inherits SIGINT as ignored, and Python
        # then installs no KeyboardInterrupt handler; give the child the default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    log = run_dir / "train_log.jsonl"
    while time.time() < deadline and not (log.exists() and log.stat().st_size > 0):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["interrupted"] is True and saved["steps"] > 0
    assert "Traceback" not in err


def test_python_m_and_console_script_agree():
    """``python -m recscale`` (how torchrun launches it) and the installed ``recscale``
    script beside this interpreter print the same help."""
    script = Path(sys.executable).parent / "recscale"
    assert script.exists(), f"no console script at {script}: is recscale installed here?"
    outs = [
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
        for cmd in ([sys.executable, "-m", "recscale", "--help"], [str(script), "--help"])
    ]
    assert "train" in outs[0]
    assert outs[0].replace("__main__.py", "recscale") == outs[1]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["config", "--config", "A"]])
def test_help_and_config_answer_without_loading_torch(argv):
    """The parser and `recscale config` need neither torch nor the training stack: in a
    fresh interpreter they load no torch module (~3 s of imports on a small VM)."""
    code = (
        "import sys\n"
        "from recscale.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip().splitlines()[-1] == "[]", out[-500:]


def test_the_cli_user_errors_name_real_exception_classes():
    """main() matches the user's errors by module and class name (so it need not import
    torch to name them): each entry is an exception class where the table says."""
    import importlib

    from recscale.cli.main import USER_ERRORS

    for module, name in USER_ERRORS:
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Exception), (module, name)


def test_cpu_threads_respected(tmp_path):
    cfg = load_config(
        "debug",
        [
            "--train.progress=false",
            "--train.steps=5",
            "--train.threads=1",
            "--data.eval_samples=512",
        ],
    )
    m = train(cfg, None, echo=_quiet)
    assert m["threads"] == 1 and torch.get_num_threads() == 1


def test_interrupt_with_checkpointing_saves_a_resumable_checkpoint(tmp_path, monkeypatch):
    original = _interrupt_at(monkeypatch, 33)
    lines = []
    cfg = load_config(
        "debug",
        ["--train.progress=false", "--data.prefetch_batches=0", "--checkpoint.every_steps=20"],
    )
    metrics = train(cfg, tmp_path, echo=lines.append)
    assert metrics["interrupted"] and metrics["steps"] == 33
    assert metrics["checkpoints"]["last"] == "step_00000033"
    assert any("no evaluation" in line for line in lines)
    monkeypatch.setattr(SyntheticCriteo, "batch", original)
    resumed = train(
        load_config(
            "debug", ["--train.progress=false", "--checkpoint.every_steps=20", "--train.steps=50"]
        ),
        tmp_path,
        resume=tmp_path,
        echo=lines.append,
    )
    assert resumed["resumed_from_step"] == 33 and resumed["auc"] > 0.7
    assert any(line.startswith("eval on") for line in lines)


def test_max_seconds_stops_at_a_step_boundary_says_so_and_saves(tmp_path, monkeypatch):
    """train.max_seconds ends the run between steps: the model is evaluated, a checkpoint
    holds the last step, and the run says it stopped for time (it read as a finished
    run, with fewer steps and no word why)."""
    original = SyntheticCriteo.batch

    def slow(self, index, batch_size, split="train"):
        if split == "train":
            time.sleep(0.02)
        return original(self, index, batch_size, split)

    monkeypatch.setattr(SyntheticCriteo, "batch", slow)
    lines = []
    cfg = load_config(
        "debug",
        [
            "--train.progress=false",
            "--data.prefetch_batches=0",
            "--train.max_seconds=0.4",
            "--checkpoint.every_steps=1000",
        ],
    )
    m = train(cfg, tmp_path, echo=lines.append)
    assert 0 < m["steps"] < cfg.train.steps and not m["interrupted"]
    assert m["stopped_by"] == "train.max_seconds" and m["auc"] is not None
    assert m["checkpoints"]["last"] == f"step_{m['steps']:08d}"
    said = f"stopped at step {m['steps']:,} of {cfg.train.steps:,}: train.max_seconds reached"
    assert said in lines
    monkeypatch.setattr(SyntheticCriteo, "batch", original)
    full = train(load_config("debug", ["--train.progress=false"]), None, echo=_quiet)
    assert "stopped_by" not in full and full["steps"] == cfg.train.steps
