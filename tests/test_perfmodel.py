"""The performance model: each stage against a hand count of FLOPs and ids, plan's output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recscale.config import load_config
from recscale.perfmodel import Calibration, Law, predict


def _unit_calibration(**rates) -> Calibration:
    """Laws that charge exactly 1 ns per FLOP (MLPs), per B*K*K*D (interaction), per
    id x dim (embeddings), per parameter (dense optimizer); nothing else."""
    z = lambda names, on: Law(names, [1e-9 if n == on else 0.0 for n in names])  # noqa: E731
    mlp = ["flops2", "mn", "mk", "kn", "one"]
    laws = {
        "mlp_forward": z(mlp, "flops2"),
        "mlp_backward": z(["flops4", "mn", "mk", "kn", "one"], "flops4"),
        "interaction": z(["bkkd", "bkk", "one"], "bkkd"),
        "lookup": z(["ids_d", "ids", "one"], "ids_d"),
        "update": z(["ids_d", "ids", "one"], "ids_d"),
        "dense_opt": z(["params", "one"], "params"),
    }
    return Calibration("test", 1, laws, **rates)


def test_each_stage_is_its_hand_count():
    cfg = load_config("debug", ["--train.batch_size=256", "--data.max_ids_per_feature=3"])
    m, b = cfg.model, 256
    p = predict(cfg, _unit_calibration())
    ms = p.stages_ms
    dims = [m.num_dense_features, *m.bottom_mlp]
    bottom = sum(2 * b * k * n for k, n in zip(dims, dims[1:]))
    assert ms["bottom_mlp"] == pytest.approx(bottom * 1e-6)  # 1 ns per FLOP, in ms
    f, d = len(m.table_sizes), m.embedding_dim
    k = f + 1
    assert ms["interaction"] == pytest.approx(b * k * k * d * 1e-6)
    ids = b * f * (1 + 3) / 2  # the synthetic data's mean ids per feature
    assert ms["lookup"] == pytest.approx(ids * d * 1e-6) == pytest.approx(ms["sparse"])
    top_in = -(-(k * (k - 1) // 2 + d) // 8) * 8  # pairs + dense, padded to 8
    tops = [top_in, *m.top_mlp]
    top = sum(2 * b * a * c for a, c in zip(tops, tops[1:]))
    assert ms["top_mlp"] == pytest.approx(top * 1e-6)
    # backward: 4 MKN a layer, the first bottom layer only its weight gradient (half)
    back = 2 * top + 2 * bottom - 0.5 * (4 * b * dims[0] * dims[1])
    assert ms["backward"] == pytest.approx(back * 1e-6)
    params = sum(a * c + c for a, c in zip(dims, dims[1:])) + sum(
        a * c + c for a, c in zip(tops, tops[1:])
    )
    assert ms["dense_opt"] == pytest.approx(params * 1e-6)
    assert p.step_seconds == pytest.approx(sum(ms.values()) / 1e3)
    assert p.samples_per_s == pytest.approx(b / p.step_seconds)


def test_step_fit_scales_and_adds():
    cfg = load_config("debug")
    base = predict(cfg, _unit_calibration())
    fitted = predict(cfg, _unit_calibration(step_scale=1.5, step_overhead=0.002))
    assert fitted.step_seconds == pytest.approx(1.5 * base.step_seconds + 0.002)


def test_calibration_round_trip_and_plan_prints_the_prediction(tmp_path):
    path = tmp_path / "cal.json"
    _unit_calibration(step_overhead=0.001).save(path)
    assert Calibration.load(path).laws["lookup"].coef[0] == 1e-9
    r = subprocess.run([sys.executable, "-m", "recscale", "plan", "--config", "debug", "--world-size", "1",
                        "--calibration", str(path), "--json"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = predict(load_config("debug"), Calibration.load(path))
    assert out["predicted_step_ms"] == pytest.approx(want.step_seconds * 1e3)
    assert out["predicted_samples_per_s"] == pytest.approx(want.samples_per_s)
