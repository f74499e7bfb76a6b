"""Preprocessing MB/s and lines/s, loader samples/s, and the training step beside them.

    python benchmarks/data_pipeline.py --lines 3000000 [--workdir /tmp/recscale-bench]

Generates a Criteo-format TSV (synthetic, cached in the workdir), preprocesses it in
hash and vocab modes, times the loader at batch 2048, and trains config A from the
hashed dataset (tables of 1M rows, like the benchmark preset) to compare the
end-to-end rate with `recscale bench throughput --config A`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import recscale  # noqa: F401  (sets the OpenMP wait policy before torch loads)
from recscale.config import load_config
from recscale.data.dataset import BatchLoader, BinaryDataset
from recscale.dataprep.criteo_tsv import write_tsv
from recscale.dataprep.preprocess import PreprocessOptions, preprocess
from recscale.train.run import train

# Speed benchmarks cycle 4 distinct blocks of 100k lines (parsing and loading speed do
# not depend on repetition, and 3M distinct lines take a minute to draw); accuracy
# benchmarks need every line distinct, or the test split repeats training lines.
SPEED_CYCLE_BLOCKS = 4


def tsv_path(workdir: Path, lines: int, cycle_blocks: int) -> Path:
    tail = f"_cycled{cycle_blocks}" if cycle_blocks else ""
    return workdir / f"criteo_synth_{lines}{tail}.tsv"


def cached_dataset(workdir: Path, lines: int, cycle_blocks: int = 0, **opts) -> Path:
    """A synthetic Criteo-format TSV of ``lines`` lines (every line distinct, or
    ``cycle_blocks`` blocks cycled) and its preprocessed dataset (``PreprocessOptions``
    fields in ``opts``), both kept in ``workdir`` for reuse."""
    workdir.mkdir(parents=True, exist_ok=True)
    tsv = tsv_path(workdir, lines, cycle_blocks)
    if not tsv.exists():
        write_tsv(tsv, lines, distinct_blocks=cycle_blocks)
    ds = workdir / f"ds_{opts.get('id_mode', 'hash')}_{tsv.stem.removeprefix('criteo_synth_')}"
    if not (ds / "metadata.json").exists():
        preprocess(PreprocessOptions(inputs=[tsv], out=ds, **opts), echo=lambda s: None)
    return ds


def loader_samples_per_s(ds: BinaryDataset, batch: int, batches: int) -> float:
    """The shuffled loader's samples/s over ``batches`` batches (after a first one)."""
    it = iter(BatchLoader(ds, batch, shuffle=True, seed=0))
    next(it)
    t, n = time.perf_counter(), 0
    for _ in range(batches):
        n += next(it).batch_size
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=3_000_000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/recscale-bench"))
    ap.add_argument("--train-steps", type=int, default=300)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = tsv_path(args.workdir, args.lines, SPEED_CYCLE_BLOCKS)
    if not src.exists():
        print(f"writing {args.lines:,} lines to {src} ...")
        write_tsv(src, args.lines, distinct_blocks=SPEED_CYCLE_BLOCKS)
    size = src.stat().st_size
    results = {"lines": args.lines, "text_mb": size / 1e6}
    for mode in ("hash", "vocab"):
        out = args.workdir / f"ds_{mode}"
        t = time.perf_counter()
        meta = preprocess(
            PreprocessOptions(
                inputs=[src],
                out=out,
                id_mode=mode,
                hash_sizes=[1_000_000] if mode == "hash" else [],
            ),
            echo=lambda s: None,
        )
        secs = time.perf_counter() - t
        results[f"preprocess_{mode}"] = {
            "seconds": secs,
            "mb_per_s": size / 1e6 / secs,
            "lines_per_s": args.lines / secs,
            "parse_mb_per_s": size / 1e6 / meta["parse_seconds"],
        }
    ds = BinaryDataset(args.workdir / "ds_hash", "train")
    results["loader_samples_per_s"] = loader_samples_per_s(ds, 2048, 300)
    cfg = load_config(
        "A",
        [
            f"--data.path={args.workdir / 'ds_hash'}",
            f"--train.steps={args.train_steps}",
            "--train.progress=false",
            "--data.eval_split=val",
            "--train.save_model=false",
        ],
    )
    run_dir = args.workdir / "run_A"
    m = train(cfg, run_dir, echo=lambda s: None)
    log = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
    results["train_A_samples_per_s_overall"] = m["samples_per_s"]
    results["train_A_samples_per_s_last_window"] = log[-1]["samples_per_s"]
    results["loader_over_training"] = results["loader_samples_per_s"] / m["samples_per_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
