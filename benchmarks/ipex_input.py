"""Time the input work Intel's MLPerf v3.1 DLRMv2 loop does on its training thread, a
step, on one core of this host: the per-id costs ``perfmodel/systems.py::IPEX`` prices.

    python benchmarks/ipex_input.py [--batch 65536] [--cap 4000000] [--repeats 5]

What Intel's code does a step (training_results_v3.1, Intel/benchmarks/dlrm_v2/
torchrec_cpu: ``data/single_hot_criteo.py``, ``multi_hot.py``, ``dlrm_main_mlperf.py``),
every rank for the global batch (its loader runs with rank 0 of world size 1):

    serial (numpy, one thread)   ids % hashes on the [B, 26] int32 one-hot ids read from
                                 the memory-mapped day; the ids transposed feature-major
                                 (a copy); the dense features and labels copied
    parallel (torch ops)         each feature's one-hot ids expanded to its multi-hot ids
                                 (F.embedding on an int32 [rows, hotness] table), then
                                 widened to int64

Timed here on synthetic ids of the same shapes and dtypes, every pass on one thread
(``torch.set_num_threads(1)``; numpy runs these on one anyway); the multi-hot tables
capped at ``--cap`` rows (their 40 M-row originals take 16 GB for feature 20 alone;
past a few MB a gather misses the cache either way). Prints each pass's median over
``--repeats`` and the costs an id: serial ns per one-hot id, core-ns per multi-hot id.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from recscale.bench.calibrate import median_seconds

# MLPerf DLRMv2 (Intel's run_mlperf_multi_rank-64k-sota.sh: NUM_EMBEDDINGS, MULTIHOT_SIZE)
ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282]
ROWS += [10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973]
ROWS += [108, 36]
HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--cap", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    b, f = args.batch, len(ROWS)
    raw = rng.integers(0, 2**31 - 1, size=(b, f), dtype=np.int32)  # ids before hashing
    hashes = np.array(ROWS, dtype=np.int32).reshape(1, f)
    dense = rng.random((b, 13), dtype=np.float32)
    labels = rng.integers(0, 2, size=(b, 1), dtype=np.int32)
    rows = [min(n, args.cap) for n in ROWS]
    tables = [
        torch.from_numpy(rng.integers(0, n, size=(n, h), dtype=np.int32))
        for n, h in zip(rows, HOTNESS)
    ]
    hashed = raw % hashes
    one_hot = torch.from_numpy(hashed.transpose(1, 0).reshape(-1)).view(f, b)
    one_hot = torch.stack([c % n for c, n in zip(one_hot, rows)])  # within the capped tables

    def expand() -> list[torch.Tensor]:
        return [torch.nn.functional.embedding(c, t).reshape(-1) for c, t in zip(one_hot, tables)]

    multi = expand()
    passes = {
        "hash (ids % hashes)": lambda: raw % hashes,
        "transpose (feature-major copy)": lambda: hashed.transpose(1, 0).reshape(-1),
        "dense and labels copied": lambda: (dense.copy(), labels.reshape(-1).copy()),
        "expand (26 F.embedding gathers)": expand,
        "widen to int64": lambda: [m.long() for m in multi],
    }
    secs = {name: median_seconds(fn, args.repeats, warmup=1) for name, fn in passes.items()}
    one_hot_ids, multi_hot_ids = b * f, b * sum(HOTNESS)
    for name, s in secs.items():
        print(f"{name:<34} {s * 1e3:8.2f} ms")
    serial = sum(secs[k] for k in list(secs)[:3])
    parallel = sum(secs[k] for k in list(secs)[3:])
    print(
        f"serial {serial * 1e3:.2f} ms = {serial / one_hot_ids * 1e9:.2f} ns a one-hot id "
        f"({one_hot_ids:,}); parallel {parallel * 1e3:.2f} ms of one core = "
        f"{parallel / multi_hot_ids * 1e9:.2f} core-ns a multi-hot id ({multi_hot_ids:,})"
    )


if __name__ == "__main__":
    main()
