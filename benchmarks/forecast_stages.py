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
from dataclasses import dataclass
from pathlib import Path

from forecast_validation import DLE_MODEL, SYSTEM_OF, capped, write_csv

from recscale.config import load_config
from recscale.perfmodel.devices import device_spec
from recscale.perfmodel.forecast import forecast


def h200_run(tree: str) -> str:
    return (
        "scripts/gpu_check.sh on one H200 (torch 2.11.0+cu130, Triton 3.6.0), 2026-11-26, "
        f"tree {tree}: recscale bench throughput --steps 50 --train.device=cuda"
    )


# trees up to da3844c ran the interaction's Gram matrix over 27 unpadded rows through
# autograd (forecast as "recscale-unpadded"); f2be6a5 pads it on a GPU ("recscale")
H200_RUN, H200_PADDED_RUN = h200_run("da3844c"), h200_run("f2be6a5")
CAPPED = " (capped(4))"
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


MEASURED = [
    Measured(
        "A 16384 TF32",
        "A",
        ["--train.batch_size=16384"],
        "h200",
        "tf32",
        {"lookup": 0.559, "forward": 0.879, "backward": 1.542, "sparse": 0.490, "dense_opt": 0.150},
        3.53,
        H200_RUN + " --config A --train.batch_size=16384 --train.precision=tf32",
    ),
    Measured(
        "B 16384 TF32",
        "B",
        ["--train.batch_size=16384"],
        "h200",
        "tf32",
        {"lookup": 0.558, "forward": 1.105, "backward": 2.398, "sparse": 0.607, "dense_opt": 0.145},
        4.75,
        H200_RUN + " --config B --train.batch_size=16384 --train.precision=tf32",
    ),
    # DLE's model with the tables capped at 4 GB
    Measured(
        "DLE model 65536 TF32",
        "criteo_terabyte",
        [*capped(4), *DLE_MODEL, "--train.batch_size=65536"],
        "h200",
        "tf32",
        {"lookup": 0.847, "forward": 3.440, "backward": 7.765, "sparse": 1.341, "dense_opt": 0.043},
        13.43,
        H200_RUN + " --config criteo_terabyte (capped(4)) --train.batch_size=65536, SGD",
    ),
    Measured(
        "DCNv2 6912 TF32",
        "criteo_multihot_dcnv2",
        [*capped(4), "--train.batch_size=6912"],
        "h200",
        "tf32",
        {"lookup": 0.724, "forward": 1.321, "backward": 4.043, "sparse": 1.320, "dense_opt": 0.286},
        7.74,
        H200_RUN + " --config criteo_multihot_dcnv2 (capped(4)) --train.batch_size=6912",
    ),
    Measured(
        "A 16384 TF32 padded",
        "A",
        ["--train.batch_size=16384"],
        "h200",
        "tf32",
        {"lookup": 0.707, "forward": 1.258, "backward": 1.853, "sparse": 0.563, "dense_opt": 0.226},
        4.58,
        H200_PADDED_RUN + " --config A --train.batch_size=16384 --train.precision=tf32",
        "recscale",
    ),
    Measured(
        "B 16384 TF32 padded",
        "B",
        ["--train.batch_size=16384"],
        "h200",
        "tf32",
        {"lookup": 0.648, "forward": 1.183, "backward": 2.112, "sparse": 0.622, "dense_opt": 0.183},
        4.69,
        H200_PADDED_RUN + " --config B --train.batch_size=16384 --train.precision=tf32",
        "recscale",
    ),
    Measured(
        "DLE model 65536 TF32 padded",
        "criteo_terabyte",
        [*capped(4), *DLE_MODEL, "--train.batch_size=65536"],
        "h200",
        "tf32",
        {"lookup": 0.920, "forward": 3.410, "backward": 5.677, "sparse": 1.328, "dense_opt": 0.036},
        11.36,
        H200_PADDED_RUN + " --config criteo_terabyte" + CAPPED + " --train.batch_size=65536, SGD",
        "recscale",
    ),
    Measured(
        "DCNv2 6912 TF32 padded",
        "criteo_multihot_dcnv2",
        [*capped(4), "--train.batch_size=6912"],
        "h200",
        "tf32",
        {"lookup": 0.799, "forward": 1.397, "backward": 4.069, "sparse": 1.276, "dense_opt": 0.435},
        7.94,
        H200_PADDED_RUN + " --config criteo_multihot_dcnv2" + CAPPED + " --train.batch_size=6912",
        "recscale",
    ),
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
    ap.add_argument("--out", default="docs")
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
    write_csv(rows, Path(args.out) / "forecast_stages.csv")


if __name__ == "__main__":
    main()
