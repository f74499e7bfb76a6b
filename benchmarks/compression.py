"""Compressed and low-precision tables: table memory vs held-out AUC / logloss vs
samples/s, one epoch each (docs/compression.md).

    python benchmarks/compression.py [--data synthetic|tsv] [--ratios 4,16,64] [--out DIR]

``synthetic``: the ``default`` config on its embedded synthetic data (``--steps``
steps; one pass over fresh samples). ``tsv``: Criteo-format lines from
``recscale data synth-tsv`` (``--lines``), preprocessed in vocab mode, one epoch of
``default``'s model on it. For each method the knob (qr_buckets, tt_rank, md_alpha) is
picked from a grid so that the tables' weights (the rows alone, as "a 100 GB table
before optimizer state" counts them) are at least each target ratio smaller than the
plain fp32 model's, as close to it as the grid allows; the bytes with the optimizer
state are shown beside them. ``METHOD+PRECISION`` (e.g. ``mixed_dim+fp16``) stores the
gathered factors at that row precision; ``+hotF`` (e.g. ``tt+hot0.01``) keeps that share
of each table's rows exact (``embedding.hot_fraction``). ``compress_min_rows=0`` lets every
table take part. Writes DIR/results_DATA.csv and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.embedding.sizing import table_memory
from recscale.train.run import train

KNOBS = {
    "qr": ("qr_buckets", [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]),
    "tt": ("tt_rank", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]),
    "mixed_dim": ("md_alpha", [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0]),
}


def _memory(base: str, over: list[str]) -> tuple[float, float]:
    """(weights, with optimizer state): how many times smaller than plain fp32 tables."""
    m = table_memory(load_config(base, over))
    return m["plain_weights"] / m["weights"], m["plain_total"] / m["total"]


def pick(base: str, common: list[str], method: str, ratio: float):
    """The knob value whose tables' weights are at least ``ratio`` times smaller than
    plain and closest to it (the largest ratio of the grid if none reaches it)."""
    import math

    name, *mods = method.split("+")
    key, grid = KNOBS[name]
    extra = [
        f"--embedding.hot_fraction={m[3:]}"
        if m.startswith("hot")
        else f"--embedding.row_precision={m}"
        for m in mods
    ]
    cands = []  # (overrides, (weights ratio, with-state ratio), knob)
    for v in grid:
        over = [*common, f"--embedding.compression={name}", f"--embedding.{key}={v}", *extra]
        cands.append((over, _memory(base, over), f"{key}={v}"))
    reached = [c for c in cands if c[1][0] >= ratio * 0.999]
    if not reached:
        return max(cands, key=lambda c: c[1][0])
    return min(reached, key=lambda c: abs(math.log(c[1][0] / ratio)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", choices=["synthetic", "tsv"], default="synthetic")
    ap.add_argument("--ratios", default="4,16,64")
    ap.add_argument("--steps", type=int, default=600, help="synthetic: steps of batch 1024")
    ap.add_argument("--lines", type=int, default=600_000, help="tsv: lines to generate")
    ap.add_argument(
        "--methods",
        default="qr,mixed_dim,tt,mixed_dim+fp16,tt+fp16,tt+fp16+hot0.01,tt+fp16+hot0.05",
    )
    ap.add_argument("--out", type=Path, default=Path("compression_results"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/recscale-bench"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--train.progress=false", "--embedding.compress_min_rows=0"]
    if args.data == "synthetic":
        common += [f"--train.steps={args.steps}"]
    else:
        from data_pipeline import cached_dataset  # this folder: python benchmarks/...

        ds = cached_dataset(args.workdir, args.lines, id_mode="vocab")
        sizes = ",".join(str(n) for n in _table_sizes(ds))
        common += [
            f"--data.path={ds}",
            "--data.eval_split=val",
            "--train.epochs=1",
            f"--model.table_sizes={sizes}",
        ]
    plain = table_memory(load_config("default", common))
    runs = [("plain", "fp32", [], (1.0, 1.0), "")]
    for p in ("fp16", "bf16", "int8"):
        over = [f"--embedding.row_precision={p}"]
        runs.append((f"rows {p}", p, over, _memory("default", [*common, *over]), ""))
    for method in filter(None, args.methods.split(",")):  # "" = the precisions only
        for r in (float(x) for x in args.ratios.split(",")):
            over, got, knob = pick("default", common, method, r)
            runs.append((method, f"{r:g}x", over[len(common) :], got, knob))
    rows = []
    for name, target, over, ratio, knob in runs:
        run_dir = args.out / "runs" / f"{name}_{target}".replace(" ", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        m = train(load_config("default", [*common, *over]), run_dir, echo=lambda s: None)
        rows.append(
            {
                "method": name,
                "target": target,
                "knob": knob,
                "weights_mb": round(plain["plain_weights"] / ratio[0] / 1e6, 2),
                "smaller": round(ratio[0], 1),
                "with_state_mb": round(plain["plain_total"] / ratio[1] / 1e6, 2),
                "smaller_with_state": round(ratio[1], 1),
                "auc": round(m["auc"], 4),
                "logloss": round(m["logloss"], 4),
                "samples_per_s": round(m["samples_per_s"]),
            }
        )
        print(rows[-1], flush=True)
    with open(args.out / f"results_{args.data}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = rows[0]
    print(
        "| method | target | knob | weights MB | smaller | with state MB | smaller | AUC | dAUC "
        "| logloss | samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['target']} | {r['knob']} | {r['weights_mb']} | {r['smaller']}x "
            "| "
            f"{r['with_state_mb']} | {r['smaller_with_state']}x | "
            f"{r['auc']:.4f} | {r['auc'] - base['auc']:+.4f} | {r['logloss']:.4f} | "
            f"{r['samples_per_s']:,} |"
        )


def _table_sizes(ds: Path) -> list[int]:
    import json

    return [int(n) for n in json.loads((ds / "metadata.json").read_text())["table_sizes"]]


if __name__ == "__main__":
    main()
