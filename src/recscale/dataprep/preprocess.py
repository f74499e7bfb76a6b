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
   summaries, bad-line report) and ``OUT/id_counts.u32`` (each id's count over the
   train split: data/id_profile.py). Everything is built under ``OUT.tmp`` and renamed
   into place at the end, so a failed run never leaves a half-written dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.criteo_parse import NUM_CAT, NUM_DENSE
from recscale.data.id_profile import write_id_profile
from recscale.data.sources import PREPROCESSED_KEY, Piece, parquet_pieces, tsv_pieces
from recscale.dataprep.common import (
    BLOCK_ROWS,
    FORMAT_VERSION,
    HASH_CAP,
    BadDataError,
    BadLineReport,
    PreprocessOptions,
    check_bad_lines,
    check_free_space,
    fresh_tmp_dir,
    split_ranges,
    swap_into_place,
    writing,
)
from recscale.dataprep.id_counts import IdCounts
from recscale.dataprep.multihot_parquet import is_multi_hot_parquet, preprocess_multihot_parquet
from recscale.units import size_text


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
            "dense": np.memmap(self.root / "dense", np.float32, "r", shape=(n, NUM_DENSE))
            if n
            else np.zeros((0, NUM_DENSE), np.float32),
            "cats": np.memmap(self.root / "cats", np.uint32, "r", shape=(n, NUM_CAT))
            if n
            else np.zeros((0, NUM_CAT), np.uint32),
            "missing": np.memmap(self.root / "missing", np.uint32, "r", shape=(n,))
            if n
            else np.zeros(0, np.uint32),
            "labels": np.memmap(self.root / "labels", np.uint8, "r", shape=(n,))
            if n
            else np.zeros(0, np.uint8),
        }


def _blocks(ranges: list[tuple[int, int]]):
    for lo, hi in ranges:
        for a in range(lo, hi, BLOCK_ROWS):
            yield a, min(hi, a + BLOCK_ROWS)


def _write_parquet(split_dir: Path, out_file: Path) -> None:
    """A split's columns as Parquet (``label``, ``I1..I13`` as log(1 + x), ``C1..C26``
    as table rows), marked in its schema metadata (``PREPROCESSED_KEY``) so that
    preprocess, given it back, names it instead of counting every row bad."""
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
        marked = table.schema.with_metadata({PREPROCESSED_KEY: b"1"})
        writer = writer or pq.ParquetWriter(out_file, marked)
        writer.write_table(table)
    if writer:
        writer.close()


def preprocess(opts: PreprocessOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run both passes; returns the metadata written to ``OUT/metadata.json``. One writer
    per output; everything temporary goes on any error."""
    opts.validate()
    with writing(Path(opts.out)):
        return _preprocess(opts, echo)


def _preprocess(opts: PreprocessOptions, echo: Callable[[str], None]) -> dict[str, Any]:
    if opts.input_format == "parquet":
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
                if piece.gzip_cut:  # a short or corrupt download: never a short dataset
                    shutil.rmtree(tmp, ignore_errors=True)
                    short = piece.gzip_cut == "truncated"
                    raise BadDataError(
                        f"{path}:{line}: the gzip archive is {piece.gzip_cut} after "
                        f"{line - 1:,} lines: the file is "
                        f"{'incomplete' if short else 'corrupt'}; download it again"
                    )
            file_rows.append((path, lo, raw.rows))
            echo(
                f"parsed {path}: {raw.rows - lo:,} rows "
                f"({size_text(text_bytes / (time.perf_counter() - start))}/s so far)"
            )
    cols = raw.close()
    parse_seconds = time.perf_counter() - start
    check_bad_lines(report, raw.rows, opts, tmp, echo)

    ranges = split_ranges(opts, file_rows, raw.rows)
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
        table_sizes = [
            min(HASH_CAP, max(16, 4 * counts.summary(f)["distinct"])) for f in range(NUM_CAT)
        ]
        echo(
            f"hash sizes from the data (4 x distinct values, at most {HASH_CAP:,}): "
            f"{sum(table_sizes):,} rows in all, largest {max(table_sizes):,}"
        )
    sizes_u64 = np.array(table_sizes, np.uint64)
    # pass 2 writes each row once more (dense, ids, label; Parquet about as much again)
    per_row = (4 * NUM_DENSE + 4 * NUM_CAT + 1) * (2 if opts.parquet_out else 1)
    need = raw.rows * per_row + 8 * counts.size  # + the id profile (at most)
    check_free_space(out, need, f"preprocess ({raw.rows:,} rows)", echo)

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
    # each id's count over the train split: an ssd tier's file order (data/id_profile.py)
    tables = [counts.table_counts(f, table_sizes[f], opts.id_mode) for f in range(NUM_CAT)]
    profile = write_id_profile(tmp, tables, table_sizes)
    profile["rows"] = splits_meta["train"]["rows"]

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
        "id_profile": profile,
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
        + f" in {seconds:.1f}s ({size_text(text_bytes / seconds)}/s overall, parse "
        f"{size_text(text_bytes / parse_seconds)}/s)"
    )
    return meta
