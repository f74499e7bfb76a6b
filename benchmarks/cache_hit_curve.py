"""Hit rate of the ssd tier's hot-row cache vs its size, LFU against LRU.

Replays the ids config A's tables would see (26 tables x 1M rows, synthetic Zipf
popularity with the given exponent, batch 2048) through a CachedStorage of each
size and policy - lookups and (no-op SGD) updates, no MLPs - and prints the hit
rate over the batches after a warm-up.

    python benchmarks/cache_hit_curve.py [--alpha 1.05] [--batches 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from recscale.config import load_config
from recscale.embedding.cached_storage import CachedStorage
from recscale.embedding.optimizers import SparseSGD
from recscale.train.data_source import make_synthetic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--fractions", default="0.01,0.02,0.05,0.1,0.2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = load_config("A", [f"--data.zipf_alpha={args.alpha}"])
    sizes = cfg.model.table_sizes
    offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    data = make_synthetic(cfg)
    b = cfg.train.batch_size
    batches = []
    for i in range(args.batches):
        batch = data.batch(i, b)
        feature = torch.arange(len(sizes)).repeat_interleave(b)
        batches.append(batch.values + offsets[feature])  # one id per (feature, sample)
    total = sum(sizes)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for frac in [float(x) for x in args.fractions.split(",")]:
            row = {"cache_fraction": frac}
            for policy in ("lfu", "lru"):
                st = CachedStorage(
                    total,
                    1,
                    SparseSGD(0.0),
                    Path(tmp) / f"{policy}.f32",
                    int(total * frac),
                    policy=policy,
                )
                for i, rows in enumerate(batches):
                    if i == args.warmup:
                        st.stats = type(st.stats)()
                    st.lookup(rows, torch.tensor([0, rows.numel()]), None, for_update=True)
                    st.apply_gradients(rows[:0], torch.zeros(0, 1))
                    st._update_pins.clear()
                row[policy] = st.stats.hit_rate
                del st
            results.append(row)
            if not args.json:
                print(
                    f"cache {frac:>5.0%} of rows: LFU {row['lfu']:.1%}  LRU {row['lru']:.1%}",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"alpha": args.alpha, "batch_size": b, "rows": total, "results": results}))


if __name__ == "__main__":
    main()
