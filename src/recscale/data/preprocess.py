"""``recscale data preprocess``: Criteo TSV / Parquet -> a memory-mappable binary dataset.

Two passes, bounded memory (chunks of text; blocks of rows):

1. **Parse** every input (parallel numba parser, see criteo_parse.py) and append
   good rows to raw columns in ``OUT.tmp/raw/``: dense (already log-transformed),
   raw 32-bit categorical values + a missing bitmask, labels. Bad lines are
   counted by kind with their first ``file:line`` examples.
2. **Split and map ids**: rows are assigned to splits by file or by the Kaggle
   convention; ids become ``hash`` (raw value mod table size; missing -> 0) or
   ``vocab`` (values seen >= min_count times in *train* -> 2..; rare/unseen -> 1;
   missing -> 0). Each split is written as::

       OUT/<split>/dense.f32   [rows, 13] float32, row-major
       OUT/<split>/sparse.i32  [rows, 26] int32 ids (one id per feature per row)
       OUT/<split>/labels.u8   [rows] uint8

   (multi-hot Parquet - list columns - takes ``multihot_parquet.py``'s path and
   writes the multi-hot layout of ``multihot.py``: bags of ids with offsets per row)

   plus ``OUT/metadata.json`` (rows and CTR per split, table sizes, id-frequency
   summaries, bad-line report). Everything is built under ``OUT.tmp`` and renamed
   into place at the end, so a failed run never leaves a half-written dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.criteo_parse import BAD_KINDS, NUM_CAT, NUM_DENSE
from recscale.data.id_counts import IdCounts
from recscale.data.sources import Piece, parquet_pieces, tsv_pieces

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
HASH_CAP = 40_000_000  # MLPerf's rows per table
BLOCK_ROWS = 1 << 18


class BadDataError(ValueError):
    """Too many malformed lines; the message has the counts and examples."""


@dataclass
class PreprocessOptions:
    inputs: list[Path]
    out: Path
    input_format: str = "criteo"  # criteo (TSV, plain or .gz) | parquet
    id_mode: str = "hash"  # hash | vocab
    # hash mode: one size, one per feature, or [] = auto: 4 x the feature's distinct values
    # in the train split, at most 40M (MLPerf's cap) - tables that fit the data
    hash_sizes: list[int] = field(default_factory=list)
    min_count: int = 1
    split: str = "kaggle"  # kaggle | by-file | none
    test_files: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)
    max_bad_fraction: float = 0.001
    chunk_bytes: int = 32 << 20
    threads: int = 0
    parquet_out: bool = False
    examples_per_kind: int = 5

    def all_inputs(self) -> list[Path]:
        """Every input once, in order: the train inputs, then validation, then test files."""
        return list(dict.fromkeys([*self.inputs, *self.val_files, *self.test_files]))

    def validate(self) -> None:
        if not self.inputs:
            raise ValueError("no input files")
        for p in [*self.inputs, *self.test_files, *self.val_files]:
            if not Path(p).exists():
                raise ValueError(f"input file not found: {p}")
        if self.id_mode not in ("hash", "vocab"):
            raise ValueError(f"--mode must be hash or vocab, got {self.id_mode!r}")
        if self.split not in ("kaggle", "by-file", "none"):
            raise ValueError(f"--split must be kaggle, by-file or none, got {self.split!r}")
        if self.hash_sizes and (
            len(self.hash_sizes) not in (1, NUM_CAT) or min(self.hash_sizes) <= 0
        ):
            raise ValueError(
                f"--hash-size takes 1 or {NUM_CAT} positive sizes, got {self.hash_sizes}"
            )
        if self.min_count < 1:
            raise ValueError("--min-count must be >= 1")
        if self.input_format not in ("criteo", "parquet"):
            raise ValueError(f"--format must be criteo or parquet, got {self.input_format!r}")
        if (self.test_files or self.val_files) and self.split != "by-file":
            raise ValueError(
                f"--test/--val name the files of each split, which only --split by-file uses "
                f"(this is --split {self.split}): add --split by-file"
            )
        if self.split == "by-file":
            held_out = {Path(p).resolve() for p in (self.test_files or [self.inputs[-1]])}
            held_out |= {Path(p).resolve() for p in self.val_files}
            if all(Path(p).resolve() in held_out for p in self.inputs):
                raise ValueError(
                    "--split by-file leaves no input for training (the test split defaults to "
                    "the last input): give more inputs, or name the test files with --test"
                )
        check_output_dir(Path(self.out), [*self.inputs, *self.test_files, *self.val_files])


def _is_dataset_dir(path: Path) -> bool:
    return (path / "metadata.json").is_file()


def check_output_dir(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that would destroy something: a non-empty directory that is not
    a dataset, one that holds an input, or the working directory or one of its parents."""
    o = out.resolve()
    cwd = Path.cwd().resolve()
    if o == cwd or o in cwd.parents:
        raise ValueError(f"--out {out} is the working directory or one of its parents; "
                         "name a new directory for the dataset")  # fmt: skip
    for p in inputs:
        if o in Path(p).resolve().parents:
            raise ValueError(f"--out {out} holds the input {p}; write the dataset elsewhere")
    if o.exists() and not o.is_dir():
        raise ValueError(f"--out {out} is a file; name a directory for the dataset")
    if o.is_dir() and any(o.iterdir()) and not _is_dataset_dir(o):
        raise ValueError(
            f"--out {out} is a non-empty directory that is not a recscale dataset "
            "(no metadata.json); it is left alone: name a new or empty directory"
        )
    tmp = o.with_name(o.name + ".tmp")
    leftovers = {"raw", "metadata.json", *SPLITS, "bad_lines.txt"}
    if tmp.exists() and not {c.name for c in tmp.iterdir()} <= leftovers:
        raise ValueError(f"{tmp} exists and is not a leftover of an earlier preprocess; move it")


def fresh_tmp_dir(out: Path) -> Path:
    """``OUT.tmp``, emptied: everything is built there and renamed into place at the end."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def check_bad_lines(report: BadLineReport, rows: int, opts: PreprocessOptions, tmp: Path,
                    echo: Callable[[str], None]) -> None:  # fmt: skip
    """Print the bad-line report; stop (removing ``tmp``, nothing written) when bad lines
    exceed ``--max-bad-fraction`` or no row is valid."""
    echo(report.describe())
    if report.lines and report.bad / report.lines > opts.max_bad_fraction:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BadDataError(
            f"{report.describe()}\nthat is more than --max-bad-fraction={opts.max_bad_fraction:g}; "
            "nothing was written (fix the inputs or raise the limit)"
        )
    if rows == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BadDataError("no valid rows in the inputs")


def swap_into_place(tmp: Path, out: Path) -> None:
    """Replace an old dataset without a moment where a half one could be read as whole:
    move the old one aside, rename the new one in, then delete the old one."""
    aside = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        if aside.exists() and not out.exists():
            os.replace(aside, out)  # the old dataset back where it was
        raise
    shutil.rmtree(aside, ignore_errors=True)


@dataclass
class BadLineReport:
    lines: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def add_statuses(self, status: np.ndarray, path: Path, first_line: int, limit: int) -> None:
        """Count one chunk's line statuses (0 = good) and keep the first examples per kind."""
        self.lines += status.shape[0]
        bad_idx = np.nonzero(status)[0]
        if bad_idx.size == 0:
            return
        kinds, counts = np.unique(status[bad_idx], return_counts=True)
        for code, n in zip(kinds.tolist(), counts.tolist()):
            kind = BAD_KINDS[code]
            self.counts[kind] = self.counts.get(kind, 0) + n
            ex = self.examples.setdefault(kind, [])
            if len(ex) < limit:
                where = bad_idx[status[bad_idx] == code][: limit - len(ex)]
                ex.extend(f"{path}:{first_line + int(i)}" for i in where)

    def add(self, kind: str, where: str, limit: int) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        ex = self.examples.setdefault(kind, [])
        if len(ex) < limit:
            ex.append(where)

    def describe(self) -> str:
        if not self.counts:
            return f"0 bad lines of {self.lines:,}"
        parts = [f"{self.bad:,} bad lines of {self.lines:,} ({self.bad / max(self.lines, 1):.4%}):"]
        for kind, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            parts.append(f"  {kind}: {n:,} (e.g. {', '.join(self.examples[kind])})")
        return "\n".join(parts)


class _RawColumns:
    """Append-only raw column files of pass 1."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.files = {n: open(root / n, "wb") for n in ("dense", "cats", "missing", "labels")}
        self.rows = 0

    def append(self, piece: Piece) -> None:
        for c in piece.chunks:
            r = c.rows
            self.files["dense"].write(c.dense[:r].tobytes())
            self.files["cats"].write(c.cats[:r].tobytes())
            self.files["missing"].write(c.missing[:r].tobytes())
            self.files["labels"].write(c.labels[:r].tobytes())
            self.rows += r

    def close(self) -> dict[str, np.ndarray]:
        for f in self.files.values():
            f.close()
        n = self.rows
        return {
            "dense": np.memmap(self.root / "dense", np.float32, "r", shape=(n, NUM_DENSE)) if n else np.zeros((0, NUM_DENSE), np.float32),
            "cats": np.memmap(self.root / "cats", np.uint32, "r", shape=(n, NUM_CAT)) if n else np.zeros((0, NUM_CAT), np.uint32),
            "missing": np.memmap(self.root / "missing", np.uint32, "r", shape=(n,)) if n else np.zeros(0, np.uint32),
            "labels": np.memmap(self.root / "labels", np.uint8, "r", shape=(n,)) if n else np.zeros(0, np.uint8),
        }  # fmt: skip


def _split_ranges(
    opts: PreprocessOptions, file_rows: list[tuple[Path, int, int]], total: int
) -> dict[str, list[tuple[int, int]]]:
    """Row ranges of each split in the raw columns."""
    if opts.split == "none":
        return {"train": [(0, total)]}
    if opts.split == "kaggle":
        # Reference DLRM: 7 "days" of equal size; days 0-5 train, day 6 halved into val and test.
        train_end = total * 6 // 7
        val_end = train_end + (total - train_end) // 2
        return {
            "train": [(0, train_end)],
            "val": [(train_end, val_end)],
            "test": [(val_end, total)],
        }
    test = {Path(p).resolve() for p in (opts.test_files or [opts.inputs[-1]])}
    val = {Path(p).resolve() for p in opts.val_files}
    out: dict[str, list[tuple[int, int]]] = {"train": [], "val": [], "test": []}
    for path, lo, hi in file_rows:
        name = "test" if path.resolve() in test else "val" if path.resolve() in val else "train"
        out[name].append((lo, hi))
    return {k: v for k, v in out.items() if v}


def _blocks(ranges: list[tuple[int, int]]):
    for lo, hi in ranges:
        for a in range(lo, hi, BLOCK_ROWS):
            yield a, min(hi, a + BLOCK_ROWS)


def _write_parquet(split_dir: Path, out_file: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = json.loads((split_dir / "rows.json").read_text())
    n = meta["rows"]
    dense = np.memmap(split_dir / "dense.f32", np.float32, "r", shape=(n, NUM_DENSE))
    sparse = np.memmap(split_dir / "sparse.i32", np.int32, "r", shape=(n, NUM_CAT))
    labels = np.memmap(split_dir / "labels.u8", np.uint8, "r", shape=(n,))
    names = (
        ["label"] + [f"I{k + 1}" for k in range(NUM_DENSE)] + [f"C{k + 1}" for k in range(NUM_CAT)]
    )
    writer = None
    for a in range(0, n, BLOCK_ROWS):
        b = min(n, a + BLOCK_ROWS)
        cols = [pa.array(labels[a:b])] + [pa.array(dense[a:b, k]) for k in range(NUM_DENSE)]
        cols += [pa.array(sparse[a:b, k]) for k in range(NUM_CAT)]
        table = pa.Table.from_arrays(cols, names=names)
        writer = writer or pq.ParquetWriter(out_file, table.schema)
        writer.write_table(table)
    if writer:
        writer.close()


def preprocess(opts: PreprocessOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run both passes; returns the metadata written to ``OUT/metadata.json``."""
    opts.validate()
    if opts.input_format == "parquet":
        from recscale.data.multihot_parquet import is_multi_hot_parquet, preprocess_multihot_parquet

        if is_multi_hot_parquet(Path(opts.inputs[0])):  # list columns: bags of ids
            if opts.parquet_out:
                raise ValueError("--parquet-out writes one-hot columns; the input is multi-hot")
            return preprocess_multihot_parquet(opts, echo)
    threads = opts.threads or len(os.sched_getaffinity(0))
    out = Path(opts.out)
    tmp = fresh_tmp_dir(out)
    start = time.perf_counter()
    report = BadLineReport()
    raw = _RawColumns(tmp / "raw")
    file_rows: list[tuple[Path, int, int]] = []
    text_bytes = 0
    all_inputs = opts.all_inputs()
    with ThreadPoolExecutor(threads) as pool:
        for path in all_inputs:
            path = Path(path)
            lo = raw.rows
            if opts.input_format == "parquet":
                pieces = parquet_pieces(path)
            else:
                pieces = tsv_pieces(path, opts.chunk_bytes, pool, threads)
            for piece in pieces:
                text_bytes += piece.text_bytes
                line = piece.first_line
                for c in piece.chunks:
                    report.add_statuses(c.status[: c.lines], path, line, opts.examples_per_kind)
                    line += c.lines
                raw.append(piece)
                if piece.truncated:  # an incomplete download: never silently a short dataset
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise BadDataError(
                        f"{path}:{line}: the gzip archive is truncated (it ends after "
                        f"{line - 1:,} lines): the file is incomplete; download it again"
                    )
            file_rows.append((path, lo, raw.rows))
            echo(
                f"parsed {path}: {raw.rows - lo:,} rows ({text_bytes / 1e6 / (time.perf_counter() - start):.0f} MB/s so far)"
            )
    cols = raw.close()
    parse_seconds = time.perf_counter() - start
    check_bad_lines(report, raw.rows, opts, tmp, echo)

    ranges = _split_ranges(opts, file_rows, raw.rows)
    counts = IdCounts(NUM_CAT)
    for a, b in _blocks(ranges["train"]):
        counts.add(
            np.ascontiguousarray(cols["cats"][a:b]), np.ascontiguousarray(cols["missing"][a:b])
        )
    if opts.id_mode == "vocab":
        table_sizes = counts.assign_vocab(opts.min_count)
    elif opts.hash_sizes:
        table_sizes = list(opts.hash_sizes) * (NUM_CAT if len(opts.hash_sizes) == 1 else 1)
    else:  # auto: room for the values the data has (~22% of them share a row), <= 40M
        table_sizes = [min(HASH_CAP, max(16, 4 * counts.summary(f)["distinct"]))
                       for f in range(NUM_CAT)]  # fmt: skip
        echo(f"hash sizes from the data (4 x distinct values, at most {HASH_CAP:,}): "
             f"{sum(table_sizes):,} rows in all, largest {max(table_sizes):,}")  # fmt: skip
    sizes_u64 = np.array(table_sizes, np.uint64)

    splits_meta: dict[str, Any] = {}
    for name, rng in ranges.items():
        d = tmp / name
        d.mkdir()
        rows, clicks = 0, 0
        with (
            open(d / "dense.f32", "wb") as fd,
            open(d / "sparse.i32", "wb") as fs,
            open(d / "labels.u8", "wb") as fl,
        ):
            for a, b in _blocks(rng):
                cats, miss = (
                    np.ascontiguousarray(cols["cats"][a:b]),
                    np.ascontiguousarray(cols["missing"][a:b]),
                )
                if opts.id_mode == "vocab":
                    ids = counts.map(cats, miss)
                else:
                    ids = (cats.astype(np.uint64) % sizes_u64).astype(np.int32)
                    missing_bits = (miss[:, None] >> np.arange(NUM_CAT, dtype=np.uint32)) & 1
                    ids[missing_bits.astype(bool)] = 0
                fd.write(np.ascontiguousarray(cols["dense"][a:b]).tobytes())
                fs.write(ids.tobytes())
                labels = np.asarray(cols["labels"][a:b])
                fl.write(labels.tobytes())
                rows += b - a
                clicks += int(labels.sum(dtype=np.int64))
        (d / "rows.json").write_text(json.dumps({"rows": rows}))
        splits_meta[name] = {"rows": rows, "ctr": clicks / rows if rows else None}
        if opts.parquet_out:
            _write_parquet(d, tmp / f"{name}.parquet")
    del cols
    shutil.rmtree(tmp / "raw")

    seconds = time.perf_counter() - start
    meta = {
        "format_version": FORMAT_VERSION,
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_CAT,
        "feature_names": [f"C{k + 1}" for k in range(NUM_CAT)],
        "table_sizes": [int(s) for s in table_sizes],
        "id_mode": opts.id_mode,
        "min_count": opts.min_count if opts.id_mode == "vocab" else None,
        "hash_sizes": table_sizes if opts.id_mode == "hash" else None,
        "splits": splits_meta,
        "split_rule": opts.split,
        "inputs": [str(p) for p in all_inputs],
        "id_frequency_train": {f"C{k + 1}": counts.summary(k) for k in range(NUM_CAT)},
        "bad_lines": {
            "lines": report.lines,
            "bad": report.bad,
            "counts": report.counts,
            "examples": report.examples,
        },
        "text_bytes": text_bytes,
        "parse_seconds": parse_seconds,
        "seconds": seconds,
    }
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    swap_into_place(tmp, out)
    echo(
        f"wrote {out}: "
        + ", ".join(f"{k} {v['rows']:,} rows" for k, v in splits_meta.items())
        + f" in {seconds:.1f}s ({text_bytes / 1e6 / seconds:.0f} MB/s overall, parse {text_bytes / 1e6 / parse_seconds:.0f} MB/s)"
    )
    return meta
