"""Validate the performance model: predicted vs measured step time on configurations
the calibration never saw (the calibration fits per-op laws on isolated ops, plus one
per-step constant from the `debug` and `default` configs; none of the points below).

    python benchmarks/perfmodel_validation.py [--calibration PATH] [--out DIR]
    python benchmarks/perfmodel_validation.py --world-size 2   # 2 local ranks, 1 thread each

With ``--world-size W`` the points run on W local ranks (gloo, the training path's
sequential step: input dist, lookups, output dist, MLPs, backward, all-reduce) under
the plan the planner makes from the same calibration, which is taken at the threads a
rank has, its whole-step fit on W local ranks (``calibrate(threads=T, world_size=W)``,
saved to DIR/calibration.json; none of its step configurations is a point below) - the
prediction includes the all-to-all and all-reduce laws measured on this host's
loopback.

Unless ``--calibration PATH`` names a saved one, the run calibrates first (saved to
DIR/calibration.json): the model is validated against the machine as it is now.

Writes DIR/validation.csv and DIR/predicted_vs_measured.png and prints the median and
worst absolute relative error.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from recscale.bench.calibrate import calibrate, measure_step
from recscale.bench.throughput import run_throughput
from recscale.config import load_config
from recscale.perfmodel import Calibration, predict
from recscale.perfmodel.fit import fit_step_constants, step_configs

BIG_MLP = ["--model.top_mlp=1024,512,256,1"]
POINTS = [
    *[
        [f"--model.embedding_dim={d}", f"--model.bottom_mlp=512,256,{d}", f"--train.batch_size={b}"]
        for d in (8, 16, 32, 64)
        for b in (256, 1024, 4096)
    ],
    *[
        [f"--data.max_ids_per_feature={p}", f"--train.batch_size={b}"]
        for p in (3, 6)
        for b in (512, 2048)
    ],
    *[[*BIG_MLP, f"--train.batch_size={b}"] for b in (512, 2048)],
    ["--model.interaction=cat", "--train.batch_size=2048"],
    ["--model.interaction=cat", "--train.batch_size=512"],
    [
        "--model.interaction=dcnv2",
        "--model.dcn_rank=64",
        "--model.dcn_layers=2",
        "--train.batch_size=1024",
    ],
    [
        "--model.interaction=dcnv2",
        "--model.dcn_rank=128",
        "--model.dcn_layers=3",
        "--train.batch_size=2048",
    ],
    ["--embedding.optimizer=sgd", "--train.batch_size=2048"],
    ["--model.bottom_mlp=256,16", "--model.top_mlp=256,1", "--train.batch_size=4096"],
]


# Several ranks: each point also names a sharding ("auto" = the planner's choice).
DIST_POINTS = [
    ["--train.batch_size=1024"],
    ["--train.batch_size=4096"],
    ["--model.embedding_dim=64", "--model.bottom_mlp=512,256,64", "--train.batch_size=2048"],
    ["--distributed.sharding=row_wise", "--train.batch_size=2048"],
    ["--distributed.sharding=table_wise", "--train.batch_size=2048"],
    ["--data.max_ids_per_feature=6", "--train.batch_size=2048"],
]


def _measure(cfg, args) -> float:
    if args.world_size == 1:
        r = run_throughput(cfg, steps=args.steps, warmup=5, echo=lambda _m: None)
        return r["ms_per_step"]
    from recscale.bench.distributed import run_pipeline_bench

    r = run_pipeline_bench(cfg, args.world_size, args.steps, 5, args.threads)
    return r["sequential_step_ms"]


def _plan(cfg, cal, w: int):
    if w == 1:
        return None
    from recscale.perfmodel.model import default_plan

    return default_plan(cfg, cal, w)  # what the job plans


def plot(rows: list[dict], world_size: int, path: Path) -> None:
    """Predicted against measured ms per step, one point per configuration (log axes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 5))
    ms = [float(r["measured_ms"]) for r in rows]
    ps = [float(r["predicted_ms"]) for r in rows]
    ax.scatter(ms, ps)
    top = max(ms + ps) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms/step")
    ax.set_ylabel("predicted ms/step")
    ax.set_title(f"performance model, held-out configs, {world_size} rank(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", default="perfmodel_validation")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5, help="runs a point (the median counts)")
    ap.add_argument("--world-size", type=int, default=1, help="local ranks a point runs on")
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank (W > 1)")
    ap.add_argument("--replot", default=None, help="only redraw the plot of a validation.csv")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot, newline="") as f:
            rows = list(csv.DictReader(f))
        plot(rows, args.world_size, Path(args.replot).with_suffix(".png"))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = args.world_size
    # A fresh calibration by default, taken in this run: a saved one from another hour
    # of a shared VM mis-states its small steps by 30-50% (docs/perfmodel.md).
    path = Path(args.calibration) if args.calibration else out / "calibration.json"
    if not args.calibration or not path.exists():
        if w == 1:
            calibrate().save(path)
        else:
            calibrate(threads=args.threads, collective_ranks=w, world_size=w).save(path)
    cal = Calibration.load(path)
    points = POINTS if w == 1 else DIST_POINTS
    cfgs = []
    for over in points:
        cfg = load_config("default", ["--train.device=cpu", *over])
        cfg.distributed.calibration = str(path)  # the job plans with the same laws
        cfgs.append(cfg)
    # Rounds over every point with the calibration's whole-step configs ("anchors")
    # interleaved: a shared VM drifts by 30% within minutes, and a point measured in a
    # slow spell against constants fitted in a fast one reads as model error. The
    # anchors' medians refit the two whole-step constants in the same rounds (none is a
    # point); the per-op laws stay those of the calibration.
    anchors = step_configs(cal.threads)
    every = max(1, len(points) // (2 * len(anchors)))  # each anchor twice a round
    runs: list[list[float]] = [[] for _ in points]
    anchor_runs: list[list[float]] = [[] for _ in anchors]
    k = 0
    for r in range(args.repeats):
        for i, cfg in enumerate(cfgs):
            runs[i].append(_measure(cfg, args))
            if i % every == 0:
                a = k % len(anchors)
                anchor_runs[a].append(measure_step(anchors[a], cal.threads, w))
                k += 1
            print(
                f"round {r + 1}/{args.repeats}: {i + 1}/{len(points)} points", end="\r", flush=True
            )
    print()
    fit_step_constants(cal, [statistics.median(a) for a in anchor_runs])
    cal.save(out / "calibration_in_run.json")
    rows = []
    for i, over in enumerate(points):
        p = predict(cfgs[i], cal, w, _plan(cfgs[i], cal, w))
        measured, predicted = statistics.median(runs[i]), p.step_seconds * 1e3
        err = (predicted - measured) / measured
        rows.append(
            {
                "point": " ".join(o.lstrip("-") for o in over),
                "measured_ms": round(measured, 3),
                "predicted_ms": round(predicted, 3),
                "error": round(err, 4),
                "spread": round((max(runs[i]) - min(runs[i])) / measured, 4),
            }
        )
        print(
            f"{i + 1:2d}/{len(points)} {rows[-1]['point']:<70} measured {measured:8.2f} ms "
            f"(spread {rows[-1]['spread']:.0%})  predicted {predicted:8.2f} ms  error {err:+.1%}",
            flush=True,
        )
    with open(out / "validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    errs = [abs(r["error"]) for r in rows]
    print(
        f"{len(rows)} configurations: median |error| {statistics.median(errs):.1%}, "
        f"worst {max(errs):.1%}"
    )
    plot(rows, w, out / "predicted_vs_measured.png")


if __name__ == "__main__":
    main()
