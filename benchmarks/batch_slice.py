"""Time ``Batch.slice``: a rank's share of a global batch (every step of a run on
several ranks) and a held-out set cut into small evaluation batches.

    python benchmarks/batch_slice.py [--config A] [--ranks 2] [--eval-batch 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from recscale.config import load_config
from recscale.train.data_source import eval_batches, make_synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--eval-batch", type=int, default=7)
    ap.add_argument("--eval-samples", type=int, default=20000)
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    b = cfg.train.batch_size * args.ranks
    batch = make_synthetic(cfg).batch(0, b)
    n = b // args.ranks
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for r in range(args.ranks):
            batch.slice(r * n, (r + 1) * n)
        times.append((time.perf_counter() - t) / args.ranks)
    print(
        f"config {args.config}: a rank's {n:,} of a global batch of {b:,} "
        f"({batch.values.numel():,} ids): {1e3 * statistics.median(times):.3f} ms (median of 7)"
    )
    over = [
        f"--data.eval_samples={args.eval_samples}",
        f"--train.eval_batch_size={args.eval_batch}",
    ]
    t = time.perf_counter()
    cut = sum(1 for _ in eval_batches(load_config("debug", over)))
    print(
        f"debug held-out set of {args.eval_samples:,} cut into {cut:,} batches of "
        f"{args.eval_batch}: {time.perf_counter() - t:.2f} s"
    )


if __name__ == "__main__":
    main()
