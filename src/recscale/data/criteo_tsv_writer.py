"""Write Criteo-format TSV files (label, 13 ints, 26 hex ids; ~missing fields as in the
real logs) for tests, benchmarks and trying the pipeline without the real data.

Ids follow per-feature Zipf popularity (data/synthetic.py); the label depends on
the ids, so a model trained on the result learns something.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from recscale.data.synthetic import zipf_ranks

_CARDINALITIES = [1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 9_314, 5_683, 80_000, 3_194,
                  27, 14_992, 60_000, 10, 5_652, 2_173, 4, 70_000, 18, 15, 28_618, 105, 14_257]  # fmt: skip


def synthetic_lines(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    salts = np.random.default_rng(12345).integers(0, 2**32, size=26, dtype=np.uint64)
    ranks = np.stack([zipf_ranks(rng.random(count), n, 1.05) for n in _CARDINALITIES], axis=1)
    hexes = (
        (ranks.astype(np.uint64) * np.uint64(2654435761) + salts) & np.uint64(0xFFFFFFFF)
    ).astype(np.uint32)
    signal = (np.sin(ranks[:, :6].astype(np.float64)).sum(axis=1)) * 0.8
    labels = (rng.random(count) < 1 / (1 + np.exp(-(signal - 1.2)))).astype(int)
    ints = np.floor(rng.lognormal(1.5, 1.5, size=(count, 13))).astype(np.int64) - 1
    int_missing = rng.random((count, 13)) < 0.15
    cat_missing = rng.random((count, 26)) < 0.04
    lines = []
    for r in range(count):
        ints_s = ["" if int_missing[r, k] else str(ints[r, k]) for k in range(13)]
        cats_s = ["" if cat_missing[r, k] else f"{hexes[r, k]:08x}" for k in range(26)]
        lines.append("\t".join([str(labels[r]), *ints_s, *cats_s]))
    return lines


def write_tsv(
    path: Path, lines: int, seed: int = 0, block: int = 100_000, distinct_blocks: int = 4
) -> int:
    """Write ``lines`` lines (``.gz`` paths are gzip-compressed). Returns bytes of text.

    For speed, ``distinct_blocks`` blocks of ``block`` lines are generated and then
    cycled; parsing speed does not depend on repetition.
    """
    blocks = [("\n".join(synthetic_lines(min(block, lines), seed + i)) + "\n").encode()
              for i in range(min(distinct_blocks, -(-lines // block)))]  # fmt: skip
    opener = gzip.open if str(path).endswith(".gz") else open
    written = total = 0
    with opener(path, "wb") as f:
        i = 0
        while written < lines:
            data = blocks[i % len(blocks)]
            n = min(block, lines - written)
            if n < min(block, lines):
                data = b"".join(line + b"\n" for line in data.split(b"\n")[:n])
            f.write(data)
            written += n
            total += len(data)
            i += 1
    return total
