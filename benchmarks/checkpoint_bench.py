"""Checkpoint cost and quality.

    python benchmarks/checkpoint_bench.py [--workdir /tmp/recscale-ckpt-bench]

1. Config A with Zipf-skewed ids (alpha 1.1), checkpoint every 50 steps for 200
   steps (full, incremental, incremental, full) in fp32, fp16 and int8: bytes,
   write seconds and the training stall of each checkpoint.
2. Quality: the default model trained 1500 steps uninterrupted vs checkpointed at
   step 750 in fp32 / fp16 / int8 and resumed: held-out AUC and logloss.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.train.run import train

QUIET = {"echo": lambda *_: None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/recscale-ckpt-bench"))
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    out: dict = {"cost": {}, "quality": {}}
    for precision in ("fp32", "fp16", "int8"):
        cfg = load_config(
            "A",
            [
                "--data.zipf_alpha=1.1",
                "--train.steps=200",
                "--checkpoint.every_steps=50",
                "--checkpoint.full_every=3",
                "--checkpoint.keep=4",
                f"--checkpoint.precision={precision}",
                "--train.progress=false",
                "--data.eval_samples=16384",
                "--train.save_model=false",
            ],
        )
        m = train(cfg, args.workdir / f"A_{precision}", **QUIET)
        out["cost"][precision] = {
            "samples_per_s": m["samples_per_s"],
            "stall_s_total": m["checkpoints"]["stall_s"],
            "history": m["checkpoints"]["history"],
        }
        shutil.rmtree(args.workdir / f"A_{precision}")
    if args.skip_quality:
        print(json.dumps(out, indent=2))
        return
    base = ["--train.progress=false", "--train.steps=1500", "--checkpoint.every_steps=750"]
    ref = train(load_config(None, base), args.workdir / "ref", **QUIET)
    out["quality"]["uninterrupted"] = {"auc": ref["auc"], "logloss": ref["logloss"]}
    for precision in ("fp32", "fp16", "int8"):
        run = args.workdir / f"q_{precision}"
        train(
            load_config(
                None,
                [
                    *base[:1],
                    "--train.steps=750",
                    "--checkpoint.every_steps=750",
                    f"--checkpoint.precision={precision}",
                ],
            ),
            run,
            **QUIET,
        )
        m = train(load_config(None, base), run, resume=run, **QUIET)
        out["quality"][f"resumed_from_{precision}"] = {"auc": m["auc"], "logloss": m["logloss"]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
