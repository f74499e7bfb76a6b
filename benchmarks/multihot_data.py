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
import shutil
import time
from pathlib import Path

import numpy as np
from data_pipeline import cached_dataset, loader_samples_per_s  # this folder: python benchmarks/...

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.data.dataset import BinaryDataset
from recscale.data.multihot import BLOCK_ROWS, MLPERF_BAG_SIZES, expand, to_multihot
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
    args = ap.parse_args()
    sizes = (list(MLPERF_BAG_SIZES) if args.bag_sizes == "mlperf"
             else [int(x) for x in args.bag_sizes.split(",")])  # fmt: skip
    onehot = cached_dataset(args.workdir, args.lines, hash_sizes=[1_000_000])
    out = args.workdir / f"ds_multihot_{args.lines}"
    to_multihot(onehot, out, sizes, echo=lambda s: None)  # warm: numba compiles once
    t = time.perf_counter()
    meta = to_multihot(onehot, out, sizes, echo=lambda s: None)
    secs = time.perf_counter() - t
    rows = sum(v["rows"] for v in meta["splits"].values())
    ids = sum(v["ids"] for v in meta["splits"].values())
    res = {"rows": rows, "ids_per_row": ids / rows, "multihot_seconds": secs,
           "multihot_rows_per_s": rows / secs, "multihot_ids_per_s": ids / secs}  # fmt: skip
    # the two bounds: the expansion kernel alone (in memory), and writing the same bytes
    # to the same disk (the output is ~4 bytes an id: at MLPerf's sizes, 0.87 GB a 1M rows)
    ds = BinaryDataset(onehot, "train")
    sparse = np.asarray(ds.sparse)
    t = time.perf_counter()
    for a in range(0, ds.rows, BLOCK_ROWS):
        expand(sparse[a : a + BLOCK_ROWS], ds.table_sizes, sizes, 0)
    res["kernel_rows_per_s"] = ds.rows / (time.perf_counter() - t)
    out_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    res["output_bytes"] = out_bytes
    res["write_bound_rows_per_s"] = rows / write_seconds(args.workdir, out_bytes)
    res["of_write_bound"] = res["multihot_rows_per_s"] / res["write_bound_rows_per_s"]
    res["loader_samples_per_s"] = loader_samples_per_s(BinaryDataset(out, "train"), 2048, 100)
    cfg = load_config("A", [f"--data.path={out}", f"--train.steps={args.train_steps}",
                            "--train.progress=false", "--data.eval_split=val"])  # fmt: skip
    run_dir = args.workdir / "run_A_multihot"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    m = train(cfg, run_dir, echo=lambda s: None)
    res["train_A_samples_per_s"] = m["samples_per_s"]
    res["loader_over_training"] = res["loader_samples_per_s"] / m["samples_per_s"]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
