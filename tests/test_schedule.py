"""The learning-rate schedule (warm-up, polynomial / linear decay) and training to a target."""

from __future__ import annotations

import pytest
import torch

from recscale.config import ConfigError, load_config
from recscale.config.schema import DenseOptimizerConfig
from recscale.embedding.optimizers import SparseRowwiseAdagrad
from recscale.embedding.storage import DeviceStorage
from recscale.train.run import train
from recscale.train.schedule import LRSchedule, lr_factor, schedule_note


def test_schedule_values_at_chosen_steps():
    c = DenseOptimizerConfig(warmup_steps=4, decay_start=10, decay_steps=5, decay_to=0.2)
    f = lambda t: lr_factor(c, t)  # noqa: E731
    assert [f(1), f(2), f(4)] == [0.25, 0.5, 1.0]  # linear warm-up
    assert f(5) == f(10) == 1.0  # flat until the decay starts
    assert f(11) == pytest.approx(0.2 + 0.8 * (4 / 5) ** 2)  # polynomial (squared)
    assert f(15) == pytest.approx(0.2) and f(1000) == pytest.approx(0.2)  # then it stays
    lin = DenseOptimizerConfig(decay_start=0, decay_steps=4, decay="linear")
    assert [lr_factor(lin, t) for t in (1, 2, 3, 4, 5)] == [0.75, 0.5, 0.25, 0.0, 0.0]
    assert lr_factor(DenseOptimizerConfig(), 10**6) == 1.0  # no schedule: constant


def test_schedule_sets_dense_and_embedding_rates():
    c = DenseOptimizerConfig(warmup_steps=10)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.5)
    storage = DeviceStorage(8, 4, SparseRowwiseAdagrad(0.1))
    sched = LRSchedule(c, opt, [storage], 0.1)
    sched.step(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.15)
    assert storage.optimizer.lr == pytest.approx(0.03)
    sched.step(10)
    assert opt.param_groups[0]["lr"] == pytest.approx(
        0.5
    ) and storage.optimizer.lr == pytest.approx(0.1)


def test_schedule_keys_are_checked():
    with pytest.raises(ConfigError, match="optimizer.decay"):
        load_config("debug", ["--optimizer.decay=cosine"])
    with pytest.raises(ConfigError, match="optimizer.decay_start"):
        load_config(
            "debug",
            [
                "--optimizer.warmup_steps=100",
                "--optimizer.decay_steps=10",
                "--optimizer.decay_start=50",
            ],
        )
    with pytest.raises(ConfigError, match="train.target_auc.*eval_every"):
        load_config("debug", ["--train.target_auc=0.8"])


def test_a_schedule_the_run_does_not_reach_is_announced():
    """A warm-up longer than the run leaves the rates short of optimizer.lr (a run of 20
    steps under 10**6 of warm-up trained at 0.002% of them and learned nothing, without
    a word); a decay that starts past the last step never acts. Both are said where the
    run starts; a schedule that fits is not."""
    cfg = DenseOptimizerConfig(warmup_steps=1_000_000)
    note = schedule_note(cfg, 20)
    assert note is not None and "warmup_steps=1000000" in note and "0.002%" in note
    assert lr_factor(cfg, 20) == pytest.approx(0.00002)  # what the note says
    decay = DenseOptimizerConfig(decay_start=30, decay_steps=10)
    assert "decay never begins" in schedule_note(decay, 30)
    assert schedule_note(decay, 31) is None
    assert schedule_note(DenseOptimizerConfig(warmup_steps=20), 20) is None
    assert schedule_note(DenseOptimizerConfig(), 1) is None
    lines: list[str] = []
    over = ["--train.progress=false", "--train.steps=3", "--optimizer.warmup_steps=300"]
    train(load_config("debug", over), None, echo=lines.append)
    assert any("climb to 1% of optimizer.lr" in line for line in lines), lines


def test_training_stops_at_the_target_auc_and_reports_the_time():
    quiet = dict(echo=lambda *_: None)
    base = [
        "--train.progress=false",
        "--data.eval_samples=8192",
        "--train.steps=3000",
        "--train.eval_every=50",
        "--optimizer.warmup_steps=20",
    ]
    m = train(load_config("debug", [*base, "--train.target_auc=0.85"]), None, **quiet)
    assert m["target_reached_step"] is not None and m["steps"] == m["target_reached_step"] < 3000
    assert m["steps"] % 50 == 0 and m["time_to_target_s"] > 0
    assert m["validation"][-1]["auc"] >= 0.85
    assert all(v["auc"] < 0.85 for v in m["validation"][:-1])
