"""Timing in turns: what ``benchmarks/peers.py --interleave`` builds on (the TorchRec side
needs its own venv and is not run here; both sides speak ``benchmarks/turn_protocol.py``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from recscale.bench.throughput import run_throughput
from recscale.config import load_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SMALL = ["--model.embedding_dim=16", "--model.bottom_mlp=32,16"]


def test_turns_time_the_steps_they_ask_for_and_the_report_covers_them_all():
    cfg = load_config("debug", SMALL)
    seen: list[list[float]] = []
    r = run_throughput(cfg, warmup=1, echo=lambda _m: None, turns=iter([2, 3]), on_turn=seen.append)
    assert [len(t) for t in seen] == [2, 3] and r["steps"] == 5
    every = [s for t in seen for s in t]
    assert r["samples_per_s"] == pytest.approx(cfg.train.batch_size / statistics.median(every))


def test_turns_refuse_a_tier_and_an_empty_run():
    tiered = load_config(
        "debug", [*SMALL, "--embedding.placement=host", "--embedding.cache_bytes=400000"]
    )
    with pytest.raises(ValueError, match="placement=device"):
        run_throughput(tiered, warmup=1, echo=lambda _m: None, turns=iter([1]))
    with pytest.raises(ValueError, match="no timed step"):
        run_throughput(load_config("debug", SMALL), warmup=1, echo=lambda _m: None, turns=iter([]))


@pytest.mark.parametrize(
    "precisions", [[], ["--precision", "bf16", "--row-precision", "split_bf16"]]
)
def test_the_recscale_worker_speaks_the_turn_protocol(precisions):
    """ready after the warm-up, one step_s line a turn, the report at 0 - in the
    precision and with the rows it was asked for."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCHMARKS / "peers.py"),
            "--recscale-worker",
            "debug",
            "--warmup",
            "1",
            *precisions,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate("2\n3\n0\n", timeout=120)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"ready": True}
    assert [len(x["step_s"]) for x in lines[1:3]] == [2, 3]
    assert lines[3]["steps"] == 5 and lines[3]["samples_per_s"] > 0
    want = ("bf16", "split_bf16") if precisions else ("fp32", "fp32")
    assert (lines[3]["precision"], lines[3]["row_precision"]) == want
    assert "warm-up 1 steps" in err  # progress goes to stderr, never into the protocol
