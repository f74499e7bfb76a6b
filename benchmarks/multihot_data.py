"""Multi-hot data: `recscale data multihot` rows/s, the multi-hot loader's samples/s,
and the training step beside it (the loader's margin over training).

    python benchmarks/multihot_data.py --lines 2000000 [--bag-sizes mlperf] [--workdir DIR]

Writes a synthetic Criteo-format TSV (cached), preprocesses it (hash mode, tables of
1M rows), expands it to multi-hot bags (MLPerf's 26 sizes by default: 214 ids a row),
times the loader at batch 2048, and trains config A from the multi-hot dataset.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from data_pipeline import loader_samples_per_s  # this folder: python benchmarks/...

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.data.criteo_tsv_writer import write_tsv
from recscale.data.dataset import BinaryDataset
from recscale.data.multihot import MLPERF_BAG_SIZES, to_multihot
from recscale.data.preprocess import PreprocessOptions, preprocess
from recscale.train.run import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--bag-sizes", default="mlperf")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/recscale-bench"))
    ap.add_argument("--train-steps", type=int, default=100)
    args = ap.parse_args()
    sizes = (list(MLPERF_BAG_SIZES) if args.bag_sizes == "mlperf"
             else [int(x) for x in args.bag_sizes.split(",")])  # fmt: skip
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"criteo_synth_{args.lines}.tsv"
    if not src.exists():
        write_tsv(src, args.lines)
    onehot = args.workdir / f"ds_hash_{args.lines}"
    if not (onehot / "metadata.json").exists():
        preprocess(PreprocessOptions(inputs=[src], out=onehot, hash_sizes=[1_000_000]),
                   echo=lambda s: None)  # fmt: skip
    out = args.workdir / f"ds_multihot_{args.lines}"
    to_multihot(onehot, out, sizes, echo=lambda s: None)  # warm: numba compiles once
    t = time.perf_counter()
    meta = to_multihot(onehot, out, sizes, echo=lambda s: None)
    secs = time.perf_counter() - t
    rows = sum(v["rows"] for v in meta["splits"].values())
    ids = sum(v["ids"] for v in meta["splits"].values())
    res = {"rows": rows, "ids_per_row": ids / rows, "multihot_seconds": secs,
           "multihot_rows_per_s": rows / secs, "multihot_ids_per_s": ids / secs}  # fmt: skip
    res["loader_samples_per_s"] = loader_samples_per_s(BinaryDataset(out, "train"), 2048, 100)
    cfg = load_config("A", [f"--data.path={out}", f"--train.steps={args.train_steps}",
                            "--train.progress=false", "--data.eval_split=val"])  # fmt: skip
    m = train(cfg, args.workdir / "run_A_multihot", echo=lambda s: None)
    res["train_A_samples_per_s"] = m["samples_per_s"]
    res["loader_over_training"] = res["loader_samples_per_s"] / m["samples_per_s"]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
