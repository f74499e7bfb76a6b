"""Write Criteo-format TSV files (label, 13 ints, 26 hex ids; ~missing fields as in the
real logs) for tests, benchmarks and trying the pipeline without the real data.

Ids follow per-feature Zipf popularity (data/synthetic.py); the label depends on
the ids, so a model trained on the result learns something.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np

from recscale.config.small_files import json_text, refuse_replacing_special, write_text_atomic
from recscale.data.synthetic import zipf_ranks
from recscale.units import size_text

_CARDINALITIES = [
    1460,
    583,
    100_000,
    50_000,
    305,
    24,
    12_517,
    633,
    3,
    9_314,
    5_683,
    80_000,
    3_194,
    27,
    14_992,
    60_000,
    10,
    5_652,
    2_173,
    4,
    70_000,
    18,
    15,
    28_618,
    105,
    14_257,
]


def synthetic_lines(count: int, seed: int = 0) -> list[str]:
    return synthetic_lines_and_logits(count, seed)[0]


def synthetic_lines_and_logits(count: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """The lines, and the click model's logit of each: what its labels were drawn from."""
    rng = np.random.default_rng(seed)
    salts = np.random.default_rng(12345).integers(0, 2**32, size=26, dtype=np.uint64)
    ranks = np.stack([zipf_ranks(rng.random(count), n, 1.05) for n in _CARDINALITIES], axis=1)
    hexes = (
        (ranks.astype(np.uint64) * np.uint64(2654435761) + salts) & np.uint64(0xFFFFFFFF)
    ).astype(np.uint32)
    signal = (np.sin(ranks[:, :6].astype(np.float64)).sum(axis=1)) * 0.8
    logits = signal - 1.2
    labels = (rng.random(count) < 1 / (1 + np.exp(-logits))).astype(int)
    ints = np.floor(rng.lognormal(1.5, 1.5, size=(count, 13))).astype(np.int64) - 1
    int_missing = rng.random((count, 13)) < 0.15
    cat_missing = rng.random((count, 26)) < 0.04
    lines = []
    for r in range(count):
        ints_s = ["" if int_missing[r, k] else str(ints[r, k]) for k in range(13)]
        cats_s = ["" if cat_missing[r, k] else f"{hexes[r, k]:08x}" for k in range(26)]
        lines.append("\t".join([str(labels[r]), *ints_s, *cats_s]))
    return lines, logits


def write_optimum(path: Path, logits: np.ndarray, labels: np.ndarray) -> dict:
    """The click model's own scores, as metrics: the ceiling any model can reach on these
    lines (the Bayes-optimal predictor knows the true click probability). Written for
    all lines and for the lines ``--split kaggle`` makes the test split (the last half of
    the last seventh)."""
    import torch

    from recscale.metrics import binary_metrics

    n = len(labels)
    train_end = n * 6 // 7
    test_lo = train_end + (n - train_end) // 2
    out = {
        "note": "metrics of the generator's true click probabilities (the Bayes-optimal "
        "predictor given everything the generator knows)"
    }
    for name, lo in (("all", 0), ("kaggle_test", test_lo)):
        m = binary_metrics(torch.from_numpy(logits[lo:]), torch.from_numpy(labels[lo:]).double())
        out[name] = {"lines": n - lo, "auc": m["auc"], "logloss": m["logloss"], "ne": m["ne"]}
    write_text_atomic(path, json_text(out, indent=2) + "\n")
    return out


def write_tsv(
    path: Path, lines: int, seed: int = 0, block: int = 100_000, distinct_blocks: int = 0
) -> int:
    """Write ``lines`` lines (``.gz`` paths are gzip-compressed). Returns bytes of text.

    Every line is drawn afresh by default (``distinct_blocks=0``), so the test split
    never repeats a training line and held-out metrics measure generalisation. For
    ingestion-speed tests at tens of millions of lines, ``distinct_blocks=N`` draws N
    blocks of ``block`` lines and cycles them (parsing speed does not depend on
    repetition; a model's held-out AUC does: it can memorise the repeated labels and
    score above the click model's own ceiling). Also writes ``PATH.optimum.json``
    (:func:`write_optimum`): the best AUC and logloss any model can reach on the lines.

    Streams a block at a time (memory: a block's lines, the cycled blocks, and 9 bytes
    a line for the optimum), into ``PATH.partial`` renamed at the end: a run that
    fails or is stopped leaves no file that looks whole. Refused before anything is
    written where the disk (the first block's bytes a line) or the memory cannot hold it,
    or where ``path`` is a file this function did not write (no optimum beside it).
    """
    path = Path(path)
    if path.is_dir():  # found at the final rename, after all the writing, it was EISDIR
        raise ValueError(f"--out {path} is a directory; name a file (.tsv, or .tsv.gz)")
    optimum = Path(str(path) + ".optimum.json")
    for target in (path, optimum):  # renamed over at the end
        try:
            refuse_replacing_special(target)
        except OSError as e:
            raise ValueError(f"--out: {e.strerror}") from None
    if path.exists() and not optimum.is_file():  # another program's file (a dataset's
        raise ValueError(  # metadata.json, a config): replaced, it was lost
            f"--out {path} exists and is not a TSV this command wrote (no {optimum.name} "
            "beside it); it is left alone: remove it or name another file"
        )
    if lines < 1:
        raise ValueError(f"--lines must be >= 1, got {lines}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    if distinct_blocks < 0:
        raise ValueError("--cycle-blocks must be >= 0")
    needed = -(-lines // block)
    kept: list[tuple[bytes, np.ndarray, np.ndarray]] = []  # cycled blocks, drawn once

    def block_of(i: int) -> tuple[bytes, np.ndarray, np.ndarray]:
        """Block ``i``'s text, logits and labels (its first lines where it is the last)."""
        n = min(block, lines - i * block)
        if distinct_blocks and i >= distinct_blocks:
            data, logits, labels = kept[i % distinct_blocks]
            if n < len(logits):
                data = b"".join(ln + b"\n" for ln in data.split(b"\n")[:n])
            return data, logits[:n], labels[:n]
        ls, logits = synthetic_lines_and_logits(n, seed + i)
        out = (("\n".join(ls) + "\n").encode(), logits, np.array([ln[0] == "1" for ln in ls]))
        if distinct_blocks:
            kept.append(out)
        return out

    first = block_of(0)
    _check_room(path, lines, first[0], len(first[1]))
    all_logits = np.empty(lines, np.float64)
    all_labels = np.empty(lines, np.bool_)
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)  # a killed run's, or a link planted there
    opener = gzip.open if str(path).endswith(".gz") else open
    total = 0
    try:
        with opener(partial, "xb") as f:  # created, never opened through a link
            for i in range(needed):
                data, logits, labels = first if i == 0 else block_of(i)
                f.write(data)
                all_logits[i * block : i * block + len(logits)] = logits
                all_labels[i * block : i * block + len(labels)] = labels
                total += len(data)
        write_optimum(optimum, all_logits, all_labels)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return total


def _check_room(path: Path, lines: int, sample: bytes, sample_lines: int) -> None:
    """Refuse a TSV the disk or the memory cannot hold, before a byte is written: the
    text at the sample block's bytes a line (gzip: the block compressed), the optimum's
    9 bytes a line in memory."""
    from recscale.procfs import proc_bytes

    per_line = len(sample) / sample_lines
    if str(path).endswith(".gz"):
        per_line = len(gzip.compress(sample, compresslevel=1)) / sample_lines
    need = int(per_line * lines)
    free = shutil.disk_usage(path.parent if str(path.parent) else ".").free
    if need > free:
        raise ValueError(
            f"--lines {lines:,} needs ~{size_text(need)} at {path} "
            f"({per_line:.0f} bytes a line) but its disk has {size_text(free)} free"
        )
    mem = proc_bytes("/proc/meminfo", "MemAvailable")
    if mem is not None and 9 * lines > mem:
        raise ValueError(
            f"--lines {lines:,}: the click model's optimum keeps 9 bytes a line "
            f"({size_text(9 * lines)}) and {size_text(mem)} of memory is available; "
            "write fewer lines (several files are read as one input)"
        )
