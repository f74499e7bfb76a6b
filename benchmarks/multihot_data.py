"""Multi-hot data: `recscale data multihot` rows/s, the multi-hot loader's samples/s,
and the training step beside it (the loader's margin over training).

    python benchmarks/multihot_data.py --lines 2000000 [--bag-sizes mlperf] [--workdir DIR]

Writes a synthetic Criteo-format TSV (cached), preprocesses it (hash mode, tables of
1M rows), makes it multi-hot (MLPerf's 26 sizes by default: 214 ids a row) in each
layout (``rule``: one-hot ids + the expansion, bags made by the loader; ``ids``: every
id written), and for each times the loader at batch 2048 and trains config A from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

# this folder: python benchmarks/...
from data_pipeline import SPEED_CYCLE_BLOCKS, cached_dataset, loader_samples_per_s

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.data.dataset import BinaryDataset
from recscale.data.multihot import BLOCK_ROWS, MLPERF_BAG_SIZES, expand
from recscale.dataprep.multihot import to_multihot
from recscale.train.run import train


def write_seconds(workdir: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``workdir`` in 64 MB blocks (the
    page cache and the disk behind it, as the expansion's writes meet them)."""
    block = np.ones(1 << 24, np.int32)
    path = workdir / "write_probe.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for done in range(0, nbytes, block.nbytes):
            f.write(memoryview(block[: max(1, min(block.size, (nbytes - done) // 4))]).cast("B"))
    secs = time.perf_counter() - t
    path.unlink()
    return secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--bag-sizes", default="mlperf")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/recscale-bench"))
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--layouts", default="rule,ids", help="rule, ids or both (rule,ids)")
    args = ap.parse_args()
    sizes = (
        list(MLPERF_BAG_SIZES)
        if args.bag_sizes == "mlperf"
        else [int(x) for x in args.bag_sizes.split(",")]
    )
    onehot = cached_dataset(args.workdir, args.lines, SPEED_CYCLE_BLOCKS, hash_sizes=[1_000_000])
    res: dict = {}
    # the two bounds of the ids layout: the expansion kernel alone (in memory), and
    # writing the same bytes to the same disk
    ds = BinaryDataset(onehot, "train")
    sparse = np.asarray(ds.sparse)
    expand(sparse[:BLOCK_ROWS], ds.table_sizes, sizes, 0)  # numba compiles / loads once
    t = time.perf_counter()
    for a in range(0, ds.rows, BLOCK_ROWS):
        expand(sparse[a : a + BLOCK_ROWS], ds.table_sizes, sizes, 0)
    res["kernel_rows_per_s"] = ds.rows / (time.perf_counter() - t)
    for layout in args.layouts.split(","):
        out = args.workdir / f"ds_multihot_{layout}_{args.lines}"
        shutil.rmtree(out, ignore_errors=True)  # no old output to delete inside the timing
        os.sync()  # nor earlier runs' dirty pages to flush (each run starts from a clean cache)
        t = time.perf_counter()
        meta = to_multihot(onehot, out, sizes, layout=layout, echo=lambda s: None)
        secs = time.perf_counter() - t
        rows = sum(v["rows"] for v in meta["splits"].values())
        ids = sum(v["ids"] for v in meta["splits"].values())
        r = {
            "rows": rows,
            "ids_per_row": ids / rows,
            "seconds": secs,
            "rows_per_s": rows / secs,
            "output_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
        }
        r["write_bound_rows_per_s"] = rows / write_seconds(args.workdir, r["output_bytes"])
        r["loader_samples_per_s"] = loader_samples_per_s(BinaryDataset(out, "train"), 2048, 100)
        cfg = load_config(
            "A",
            [
                f"--data.path={out}",
                f"--train.steps={args.train_steps}",
                "--train.progress=false",
                "--data.eval_split=val",
            ],
        )
        run_dir = args.workdir / "run_A_multihot"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
        m = train(cfg, run_dir, echo=lambda s: None)
        r["train_A_samples_per_s"] = m["samples_per_s"]
        r["loader_over_training"] = r["loader_samples_per_s"] / m["samples_per_s"]
        res[layout] = r
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
