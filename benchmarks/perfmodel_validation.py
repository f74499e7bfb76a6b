"""Validate the performance model: predicted vs measured step time on configurations
the calibration never saw (the calibration fits per-op laws on isolated ops, plus one
per-step constant from the `debug` and `default` configs; none of the points below).

    python benchmarks/perfmodel_validation.py [--calibration PATH] [--out DIR]

Writes DIR/validation.csv and DIR/predicted_vs_measured.png and prints the median and
worst absolute relative error.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from recscale.bench.throughput import run_throughput
from recscale.config import load_config
from recscale.perfmodel import Calibration, calibrate, default_path, predict

BIG_MLP = ["--model.top_mlp=1024,512,256,1"]
POINTS = [
    *[
        [f"--model.embedding_dim={d}", f"--model.bottom_mlp=512,256,{d}", f"--train.batch_size={b}"]
        for d in (8, 16, 32, 64)
        for b in (256, 1024, 4096)
    ],  # fmt: skip
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", default="perfmodel_validation")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3, help="runs a point (the median counts)")
    args = ap.parse_args()
    path = Path(args.calibration) if args.calibration else default_path()
    if not path.exists():
        calibrate().save(path)
    cal = Calibration.load(path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, over in enumerate(POINTS):
        cfg = load_config("default", ["--train.device=cpu", *over])
        # the median of a few runs: steps of a few ms vary by up to 30% on a shared VM
        runs = [
            run_throughput(cfg, steps=args.steps, warmup=5, echo=lambda _m: None)["ms_per_step"]
            for _ in range(args.repeats)
        ]
        p = predict(cfg, cal)
        measured, predicted = statistics.median(runs), p.step_seconds * 1e3
        err = (predicted - measured) / measured
        rows.append({"point": " ".join(o.lstrip("-") for o in over), "measured_ms": round(measured, 3),
                     "predicted_ms": round(predicted, 3), "error": round(err, 4)})  # fmt: skip
        print(
            f"{i + 1:2d}/{len(POINTS)} {rows[-1]['point']:<70} measured {measured:8.2f} ms  "
            f"predicted {predicted:8.2f} ms  error {err:+.1%}",
            flush=True,
        )
    with open(out / "validation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    errs = [abs(r["error"]) for r in rows]
    print(
        f"{len(rows)} configurations: median |error| {statistics.median(errs):.1%}, "
        f"worst {max(errs):.1%}"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        ms = [r["measured_ms"] for r in rows]
        ps = [r["predicted_ms"] for r in rows]
        ax.scatter(ms, ps)
        top = max(ms + ps) * 1.1
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured ms/step")
        ax.set_ylabel("predicted ms/step")
        ax.set_title("performance model, held-out configs")
        fig.tight_layout()
        fig.savefig(out / "predicted_vs_measured.png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
