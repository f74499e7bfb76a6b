"""End to end through the launcher: ``torchrun --nproc_per_node=2 -m recscale train``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_workers import cli_as_rank

from recscale.config import load_config
from recscale.distributed.spawn import run_ranks
from recscale.train.run import train

TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc_per_node=2",
    "--master_addr=127.0.0.1",
]
ARGS = [
    "-m",
    "recscale",
    "train",
    "--config",
    "debug",
    "--train.progress=false",
    "--data.max_ids_per_feature=2",
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    if torch.cuda.device_count() < 2:  # two ranks need two GPUs (NCCL): else gloo on the CPU
        env["RECSCALE_TEST_DEVICE"] = "cpu"
    return env


def _free_port_args():
    from recscale.distributed.spawn import free_port

    return [f"--master_port={free_port()}"]


def _torchrun(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2`` on a free port with ``args``, its output captured."""
    return subprocess.run(
        TORCHRUN + _free_port_args() + args,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )


def _ranks_device() -> str:
    """Where the 2-rank runs train (see ``_env``): compare with one process there."""
    return "auto" if torch.cuda.device_count() >= 2 else "cpu"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_killed_rank_fails_the_job(tmp_path: Path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        TORCHRUN
        + _free_port_args()
        + ARGS
        + [
            "--train.steps=1000000",
            "--train.log_every=1",
            "--distributed.timeout_s=30",
            "--run-dir",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while (
            not (run / "train_log.jsonl").exists() or not (run / "train_log.jsonl").stat().st_size
        ):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0
        assert time.monotonic() - t0 < 60
        assert "SIGKILL" in err or "Signal 9" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_row_wise_shards_with_no_rows_train_checkpoint_and_resume_like_one(
    tmp_path: Path, monkeypatch
):
    """Tables of one row, row-wise over 2 ranks: rank 1's shards hold no rows. Its
    lookup pooled uninitialised memory (a NaN at step 1) and its checkpoint part failed
    to write; now its bags sum to zeros, it writes no part, and the run - resumed at 2
    ranks - ends where one process training the same steps does."""
    tiny = ["--model.table_sizes=" + ",".join(["1"] * 26), "--train.save_model=false"]
    run = tmp_path / "run"
    more = ["--distributed.sharding=row_wise", "--checkpoint.every_steps=5"]
    out = _torchrun(ARGS + tiny + more + ["--train.steps=10", "--run-dir", str(run)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("eval on") == 1  # rank 0 speaks, once
    log = (run / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 1  # the last step's line (log_every 25), written once, by rank 0
    # the resume as the same CLI on 2 ranks, forked (torchrun's launch is tested above),
    # on the launch's device
    monkeypatch.setenv("RECSCALE_TEST_DEVICE", _env()["RECSCALE_TEST_DEVICE"])
    resume = ["train", "--resume", str(run), "--train.steps=15"]
    assert run_ranks(cli_as_rank, 2, resume, str(tmp_path), timeout=240) == [0, 0]
    said = (tmp_path / "rank0.out").read_text() + (tmp_path / "rank0.err").read_text()
    assert "resumed from" in said, said[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 15

    cfg = load_config(
        "debug",
        ["--train.steps=15", "--train.progress=false", "--data.max_ids_per_feature=2", *tiny],
    )
    cfg.train.device = _ranks_device()
    single = train(cfg, None, echo=lambda _m: None)
    assert metrics["auc"] == pytest.approx(single["auc"], abs=1e-4)
    assert metrics["logloss"] == pytest.approx(single["logloss"], abs=1e-4)


def test_a_bad_config_is_reported_once_not_once_a_rank(tmp_path: Path):
    out = _torchrun(ARGS + ["--train.bogus=1", "--run-dir", str(tmp_path)], timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("recscale: error:")]
    assert len(lines) == 1 and "'train.bogus'" in lines[0], out.stderr[-3000:]


def test_a_rank_prints_what_no_other_rank_on_its_host_said(tmp_path: Path, monkeypatch):
    from recscale.cli.output import said_by_another_rank

    attempt = tmp_path / "attempt_0"
    (attempt / "1").mkdir(parents=True)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert not said_by_another_rank("x") and not said_by_another_rank("x")  # no torchrun
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not said_by_another_rank("x") and not said_by_another_rank("x")  # one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not said_by_another_rank("bad key")  # the first to say it prints it
    assert said_by_another_rank("bad key")  # the next rank does not
    assert not said_by_another_rank("rank 1: its own device is missing")  # its own: printed
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "0" / "e.json"))
    assert not said_by_another_rank("bad key")  # no directory to claim it in: printed
