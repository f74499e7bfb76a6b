"""Fitting the performance model's constants: a cost law by non-negative least squares
on relative error, and the step-level constants (``step_scale``, ``step_overhead``)
from whole steps of ``STEP_CONFIGS`` measured by ``bench/calibrate.py``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from recscale.config import load_config
from recscale.perfmodel.calibration import Calibration, Law
from recscale.perfmodel.model import predict
from recscale.planner.from_config import plan_for


def fit_law(features: list[str], rows: list[dict[str, float]], times: list[float]) -> Law:
    """Non-negative least squares on relative error (drop a negative coefficient, refit)."""
    keep = list(range(len(features)))
    t = np.maximum(np.array(times), 5e-6)  # below timer noise, a point would dominate
    while True:
        a = np.array([[r[features[i]] for i in keep] for r in rows]) / t[:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    full = [0.0] * len(features)
    for k, c in zip(keep, coef):
        full[k] = max(0.0, float(c))
    law = Law(features, full)
    pred = np.array([law(**r) for r in rows])
    law.fit_error = float(np.median(np.abs(pred - t) / t))
    return law


STEP_CONFIGS = (
    ("debug", []),
    ("default", ["--train.batch_size=128"]),
    ("default", ["--train.batch_size=8192"]),
    (
        "default",
        ["--model.embedding_dim=24", "--model.bottom_mlp=512,256,24", "--train.batch_size=2048"],
    ),
)


def step_configs(threads: int) -> list:
    """The configs of ``STEP_CONFIGS`` on ``threads`` torch threads (the ops' threads)."""
    return [
        load_config(name, ["--train.device=cpu", f"--train.threads={threads}", *over])
        for name, over in STEP_CONFIGS
    ]


def fit_step_constants(cal: Calibration, measured_ms: list[float], echo=print) -> None:
    """Set ``step_scale`` and ``step_overhead`` from whole steps of the ``STEP_CONFIGS``
    (``measured_ms[i]`` for config i, measured on ``cal.world_size`` ranks)."""
    w = cal.world_size
    bare = replace(cal, step_scale=1.0, step_overhead=0.0)  # the sum of the ops alone
    sums, measured = [], []
    for cfg, t in zip(step_configs(cal.threads), measured_ms):
        p = predict(cfg, bare, w, plan_for(cfg, w, 1 << 40) if w > 1 else None)
        comm = sum(p.stages_ms.get(k, 0.0) for k in ("all_to_all", "all_reduce")) / 1e3
        sums.append(p.step_seconds - comm)
        measured.append(max(t / 1e3 - comm, 1e-5))
    law = fit_law(["sum", "one"], [{"sum": s_, "one": 1.0} for s_ in sums], measured)
    cal.step_scale, cal.step_overhead = law.coef[0] or 1.0, law.coef[1]
    echo(
        f"  whole steps{f' on {w} ranks' if w > 1 else ''}: "
        f"{cal.step_scale:.3f} x the ops + {cal.step_overhead * 1e3:.2f} ms "
        f"(fit error {law.fit_error:.1%})"
    )
