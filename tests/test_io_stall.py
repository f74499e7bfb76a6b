"""A tier whose device stops answering (or answers far too slowly) stops the run with
one line naming its file, after ``embedding.io_stall_seconds``, and loses nothing: the
last checkpoint resumes."""

import threading
import time

import pytest
from helpers import error_line, run_cli

from recscale.config import load_config
from recscale.distributed.pipeline import EmbeddingPipeline, InputStalled
from recscale.distributed.sharded_embedding import ShardedEmbeddingBagCollection
from recscale.train.data_source import make_synthetic


class _SlowCollection:
    """What the pipeline calls on a collection; the ``slow``-th prefetch takes ``delay``."""

    def __init__(self, slow: int, delay: float) -> None:
        self.calls, self.slow, self.delay = 0, slow, delay

    def distribute_input(self, values, offsets, batch_size, weights):
        return values

    def prefetch(self, local) -> None:
        self.calls += 1
        if self.calls == self.slow:
            time.sleep(self.delay)

    def enqueue(self, local) -> None:
        pass

    def clear_ready(self) -> None:
        pass


def test_a_batch_later_than_the_stall_limit_raises_naming_what_it_waits_on():
    data = make_synthetic(load_config("debug", []))
    batches = (data.batch(i, 64) for i in range(6))
    ebc = _SlowCollection(slow=3, delay=1.5)
    pipe = EmbeddingPipeline(batches, ebc, "cpu", 1, stall_seconds=0.5, stall_message="rows.f32")
    got = []
    t = time.perf_counter()
    with pytest.raises(InputStalled, match=r"no batch in 0.5 s: rows.f32"):
        for b in pipe:
            got.append(b)
    assert len(got) == 2 and time.perf_counter() - t < 2.5 and pipe.stalled
    pipe.close(timeout=5.0)
    # without a limit the same slow batch is waited for
    pipe = EmbeddingPipeline(
        (data.batch(i, 64) for i in range(4)), _SlowCollection(slow=2, delay=0.8), "cpu", 1
    )
    assert len(list(pipe)) == 4 and not pipe.stalled


def test_a_stalled_ssd_tier_stops_the_run_in_one_line_and_its_checkpoint_resumes(
    tmp_path, monkeypatch
):
    prefetch = ShardedEmbeddingBagCollection.prefetch
    calls = {"n": 0}
    answers = threading.Event()  # the device answers again

    def stalling(self, local):  # the device stops answering after 12 batches
        calls["n"] += 1
        if calls["n"] > 12:
            answers.wait(timeout=60)
        return prefetch(self, local)

    monkeypatch.setattr(ShardedEmbeddingBagCollection, "prefetch", stalling)
    run = tmp_path / "run"
    args = [
        "train",
        "--config=debug",
        "--train.steps=30",
        "--train.progress=false",
        "--checkpoint.every_steps=5",
        "--embedding.placement=ssd",
        "--embedding.cache_bytes=400000",
        "--embedding.cache_prefetch=thread",
        "--embedding.io_stall_seconds=1",
        f"--embedding.ssd_dir={tmp_path / 'ssd'}",
        f"--run-dir={run}",
    ]
    r = run_cli(*args)
    assert r.returncode == 1
    line = error_line(r.stderr)
    assert "no batch in 1 s" in line and str(tmp_path / "ssd") in line, line
    assert "embedding.io_stall_seconds" in line and not (run / "metrics.json").exists()
    monkeypatch.setattr(ShardedEmbeddingBagCollection, "prefetch", prefetch)
    answers.set()  # the stalled thread's read ends; its file is closed
    for thread in threading.enumerate():
        if thread.name == "recscale-input-dist":
            thread.join(timeout=60)
    r = run_cli(
        *args[:-2],
        f"--embedding.ssd_dir={tmp_path / 'ssd2'}",
        f"--run-dir={run}",
        "--resume",
        str(run),
    )
    assert r.returncode == 0, r.stderr
    assert "resumed" in (r.stdout + r.stderr).lower()
