"""recscale's GPU forecast stage by stage against its own step's CUDA-event stage times.

    python benchmarks/forecast_stages.py [--out DIR]

``benchmarks/forecast_validation.py`` checks whole steps against published systems;
this checks the parts of recscale's own step that ``recscale bench throughput`` times
on a GPU (CUDA events on the stream, no host sync inside a step), each measured run
with its command, date and device. The stages compare as::

    bench stage            forecast stages (recscale plan --device ... --json)
    lookup                 embedding_forward
    forward + backward     mlp_gemm + mlp_elementwise + interaction + loss
    sparse                 embedding_update
    dense_opt              dense_optimizer
    (whole step)           predicted_step_ms (device stages and the host's time)

Where the step is bound by the host's dispatch (``forecast_host_bound``: the forecast's host
time above its device time), the events mark when the GPU reached each stage, so the
stages carry the host's time and only the whole step compares. Writes
DIR/forecast_stages.csv (default DIR: docs/).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from forecast_validation import DLE_MODEL, SYSTEM_OF, capped, write_csv

from recscale.config import load_config
from recscale.perfmodel.devices import device_spec
from recscale.perfmodel.forecast import forecast

# the bench stages a forecast stage group is compared with
GROUPS = {
    "embedding_forward": (("lookup",), ("embedding_forward",)),
    "dense": (("forward", "backward"), ("mlp_gemm", "mlp_elementwise", "interaction", "loss")),
    "embedding_update": (("sparse",), ("embedding_update",)),
    "dense_optimizer": (("dense_opt",), ("dense_optimizer",)),
}


@dataclass(frozen=True)
class Measured:
    label: str
    config: str
    overrides: list[str]
    device: str
    precision: str
    stage_ms: dict[str, float]  # the bench's stage_ms
    step_ms: float
    source: str
    system: str = "recscale-unpadded"  # forecast_validation.SYSTEM_OF key: the code that ran


# The four points each H200 run measured: (label, config, overrides, the bench's
# command-line tail)
POINTS = [
    ("A 16384 TF32", "A", ["--train.batch_size=16384"], "--config A --train.batch_size=16384"),
    ("B 16384 TF32", "B", ["--train.batch_size=16384"], "--config B --train.batch_size=16384"),
    (
        "DLE model 65536 TF32",  # DLE's model with the tables capped at 4 GB
        "criteo_terabyte",
        [*capped(4), *DLE_MODEL, "--train.batch_size=65536"],
        "--config criteo_terabyte (capped(4)) --train.batch_size=65536, SGD",
    ),
    (
        "DCNv2 6912 TF32",
        "criteo_multihot_dcnv2",
        [*capped(4), "--train.batch_size=6912"],
        "--config criteo_multihot_dcnv2 (capped(4)) --train.batch_size=6912",
    ),
]
# Each run's stage_ms (lookup, forward, backward, sparse, dense_opt) and median step ms a
# point, in POINTS' order. Trees up to da3844c ran the interaction's Gram matrix over 27
# unpadded rows through autograd (forecast as "recscale-unpadded"); f2be6a5, ce18e55 and
# ec9e6b3 pad it on a GPU ("recscale"), each run on another H200 box (ec9e6b3 on
# 2026-11-27, the others on 2026-11-26).
RUNS = {
    ("da3844c", "recscale-unpadded", ""): [
        ((0.559, 0.879, 1.542, 0.490, 0.150), 3.53),
        ((0.558, 1.105, 2.398, 0.607, 0.145), 4.75),
        ((0.847, 3.440, 7.765, 1.341, 0.043), 13.43),
        ((0.724, 1.321, 4.043, 1.320, 0.286), 7.74),
    ],
    ("f2be6a5", "recscale", " padded"): [
        ((0.707, 1.258, 1.853, 0.563, 0.226), 4.58),
        ((0.648, 1.183, 2.112, 0.622, 0.183), 4.69),
        ((0.920, 3.410, 5.677, 1.328, 0.036), 11.36),
        ((0.799, 1.397, 4.069, 1.276, 0.435), 7.94),
    ],
    ("ce18e55", "recscale", " padded (ce18e55)"): [
        ((0.742, 1.270, 2.061, 0.620, 0.237), 4.90),
        ((0.702, 1.259, 2.207, 0.664, 0.216), 4.99),
        ((0.924, 3.436, 5.691, 1.439, 0.049), 11.49),
        ((0.787, 1.447, 4.077, 1.233, 0.409), 8.14),
    ],
    ("ec9e6b3", "recscale", " padded (ec9e6b3)"): [
        ((0.826, 1.526, 2.117, 0.601, 0.260), 5.27),
        ((0.771, 1.347, 2.354, 0.630, 0.248), 5.40),
        ((1.083, 3.543, 5.685, 1.510, 0.089), 11.91),
        ((0.747, 1.366, 4.004, 1.298, 0.382), 7.81),
    ],
}
RUN_DATE = {"ec9e6b3": "2026-11-27"}  # the others: 2026-11-26
STAGE_KEYS = ("lookup", "forward", "backward", "sparse", "dense_opt")
MEASURED = [
    Measured(
        label + suffix,
        config,
        overrides,
        "h200",
        "tf32",
        dict(zip(STAGE_KEYS, stages)),
        step,
        "scripts/gpu_check.sh on one H200 (torch 2.11.0+cu130, Triton 3.6.0), "
        f"{RUN_DATE.get(tree, '2026-11-26')}, "
        f"tree {tree}: recscale bench throughput --steps 50 --train.device=cuda {tail} "
        "--train.precision=tf32",
        system,
    )
    for (tree, system, suffix), runs in RUNS.items()
    for (label, config, overrides, tail), (stages, step) in zip(POINTS, runs)
]


def compare(points: list[Measured] = MEASURED) -> list[dict]:
    """One row a (point, stage group): measured and forecast ms, and the ratio."""
    rows = []
    for m in points:
        cfg = load_config(m.config, m.overrides)
        f = forecast(cfg, device_spec(m.device), 1, m.precision, SYSTEM_OF[m.system])
        host_bound = f.stage_ms["host"] > f.step_ms - f.stage_ms["host"]
        groups = {
            g: (sum(m.stage_ms[k] for k in bench), sum(f.stage_ms[k] for k in fc))
            for g, (bench, fc) in GROUPS.items()
        }
        groups["step"] = (m.step_ms, f.step_ms)
        # each bench stage against the forecast's timeline of it (device and host)
        groups.update({f"bench {k}": (m.stage_ms[k], f.bench_stage_ms[k]) for k in STAGE_KEYS})
        for g, (measured, predicted) in groups.items():
            rows.append(
                {
                    "point": m.label,
                    "device": m.device,
                    "stage": g,
                    "measured_ms": measured,
                    "forecast_ms": round(predicted, 4),
                    "forecast_over_measured": round(predicted / measured, 3),
                    "forecast_host_bound": host_bound,
                    "system": m.system,
                    "source": m.source,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = ap.parse_args()
    rows = compare()
    print(f"{'point':<28} {'stage':<18} {'measured':>9} {'forecast':>9} {'f/m':>6}")
    for r in rows:
        note = "  (forecast host-bound)" if r["forecast_host_bound"] else ""
        print(
            f"{r['point']:<28} {r['stage']:<18} {r['measured_ms']:>9.3f} "
            f"{r['forecast_ms']:>9.3f} {r['forecast_over_measured']:>6.2f}"
            + (note if r["stage"] == "step" else "")
        )
    bench = [r for r in rows if r["stage"].startswith("bench ")]
    # the host weights (systems.RECSCALE.host_stage_weights) are A's on the padded boxes
    fit = [r for r in bench if r["point"].startswith("A ") and r["system"] == "recscale"]
    for name, part in (
        ("A on the padded boxes (the host weights' fit)", fit),
        ("the rest (held out)", [r for r in bench if r not in fit]),
    ):
        errors = sorted(abs(r["forecast_over_measured"] - 1) for r in part)
        print(
            f"bench stages, {name}: median |error| {statistics.median(errors):.1%}, "
            f"worst {errors[-1]:.1%} over {len(errors)}"
        )
    write_csv(rows, Path(args.out) / "forecast_stages.csv")


if __name__ == "__main__":
    main()
