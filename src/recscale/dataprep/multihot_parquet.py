"""``recscale data preprocess --format parquet`` for multi-hot Parquet: categorical
columns ``C1..C26`` of type ``list<integer>`` (a bag of raw ids a row; null = an empty
bag) - scalar integer columns may be mixed in (a bag of one; null = empty).

Two passes, as the one-hot path (``preprocess.py``): (1) every input's rows, raw ids
and bags appended to ``OUT.tmp/raw`` (a multi-hot split, ids as raw uint32) with bad
rows counted by kind and ``file:row``; (2) per split, ids hashed into the tables
(``raw mod table size``; ``--hash-size`` or auto: 4 x the feature's distinct raw ids
in the train split, at most 40M) and written in the multi-hot layout of
``multihot.py``. Only the hash mode: a vocabulary over bags is not built.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.criteo_parse import (
    BAD_DENSE,
    BAD_LABEL,
    BAD_NULL_ID,
    NUM_CAT,
    NUM_DENSE,
)
from recscale.data.dataset import segment_gather
from recscale.data.multihot import open_split
from recscale.data.sources import float_nulls, id_values, parquet_dense, parquet_schema
from recscale.dataprep.common import (
    FORMAT_VERSION,
    HASH_CAP,
    BadLineReport,
    check_bad_lines,
    fresh_tmp_dir,
    split_ranges,
    swap_into_place,
)
from recscale.dataprep.multihot import MultiHotWriter

BLOCK_ROWS = 1 << 18


def is_multi_hot_parquet(path: Path) -> bool:
    import pyarrow as pa

    schema = parquet_schema(path)
    return any(
        pa.types.is_list(schema.field(f"C{k + 1}").type)
        or pa.types.is_large_list(schema.field(f"C{k + 1}").type)
        for k in range(NUM_CAT)
        if f"C{k + 1}" in schema.names
    )


def _bags(col, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list or scalar integer column -> (lengths [n], raw values, bad [n]): ``bad`` is
    0 for a good row, else its ``criteo_parse.BAD_KINDS`` code (a null id inside a bag,
    an id outside 0..2^32-1)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    bad = np.zeros(n, np.int8)
    numeric = pa.types.is_integer, pa.types.is_floating
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        if not any(is_(col.type.value_type) for is_ in numeric):
            raise ValueError(
                f"list column of {col.type.value_type}; ids must be integers (or whole floats)"
            )
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
        flat = float_nulls(pc.list_flatten(col))  # nulls dropped with their (empty) bags
        v = flat.fill_null(0).to_numpy(zero_copy_only=False)
        if flat.null_count:  # a null (or NaN) id inside a bag: the row is bad
            nulls = np.asarray(flat.is_null().to_numpy(zero_copy_only=False))
            bad[np.repeat(np.arange(n), lengths)[nulls]] = BAD_NULL_ID
    elif any(is_(col.type) for is_ in numeric):
        col = float_nulls(col)
        valid = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False))
        lengths = valid.astype(np.int64)
        v = col.drop_null().to_numpy(zero_copy_only=False)
    else:
        raise ValueError(
            f"is {col.type}; multi-hot Parquet (list columns in the first input) takes "
            "list<integer> or integer categorical columns in every input (whole floats too)"
        )
    ids, id_bad = id_values(v)
    if id_bad.any():
        rows = np.repeat(np.arange(n), lengths)[id_bad != 0]
        first = bad[rows] == 0
        bad[rows[first]] = id_bad[id_bad != 0][first]
    return lengths, ids, bad


def _read_file(path: Path, raw: MultiHotWriter, report, examples: int) -> int:
    """Append ``path``'s good rows to ``raw``; returns the rows appended."""
    import pyarrow.parquet as pq

    rows, first = 0, 1
    for rb in pq.ParquetFile(path).iter_batches(batch_size=BLOCK_ROWS):
        n = rb.num_rows
        status = np.zeros(n, np.int8)
        try:
            label = rb.column("label").to_numpy(zero_copy_only=False).astype(np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: column 'label' is {rb.column('label').type}, not 0/1 ({e})"
            ) from None
        status[~np.isin(label, (0.0, 1.0))] = BAD_LABEL
        dense, bad_dense = parquet_dense(rb, path)
        status[(status == 0) & bad_dense] = BAD_DENSE
        lengths = np.zeros((n, NUM_CAT), np.int64)
        per_feature = []
        for k in range(NUM_CAT):
            try:
                lengths[:, k], v, bad = _bags(rb.column(f"C{k + 1}"), n)
            except ValueError as e:
                raise ValueError(f"{path}: column C{k + 1}: {e}") from e
            status = np.where(status == 0, bad, status)
            per_feature.append(v)
        report.add_statuses(status, path, first, examples)
        # row-major values: row r's bag of C1, then C2, ... (feature k's bags start at
        # base[k] in ``flat``, row r's at its running sum of lengths)
        flat = np.concatenate(per_feature)
        base = np.cumsum([0] + [v.shape[0] for v in per_feature[:-1]])
        starts = np.cumsum(lengths, axis=0) - lengths + base
        good = status == 0
        idx = segment_gather(starts[good].reshape(-1), lengths[good].reshape(-1))
        try:
            raw.append(
                dense[good], lengths[good], flat[idx].view(np.int32), label[good].astype(np.uint8)
            )
        except ValueError as e:  # a bag beyond the format's 65,535 ids
            raise ValueError(f"{path} (rows {first}..{first + n - 1}): {e}") from None
        rows += int(good.sum())
        first += n
    return rows


def preprocess_multihot_parquet(opts, echo: Callable[[str], None]) -> dict[str, Any]:
    if opts.id_mode != "hash":
        raise ValueError("multi-hot Parquet (list columns) is preprocessed in --mode hash only")
    out = Path(opts.out)
    tmp = fresh_tmp_dir(out)
    start = time.perf_counter()
    report = BadLineReport()
    raw = MultiHotWriter(tmp / "raw")
    file_rows = []
    all_inputs = opts.all_inputs()
    for path in all_inputs:
        lo = raw.rows
        _read_file(Path(path), raw, report, opts.examples_per_kind)
        file_rows.append((Path(path), lo, raw.rows))
        echo(f"read {path}: {raw.rows - lo:,} rows")
    info = raw.close()
    check_bad_lines(report, raw.rows, opts, tmp, echo)
    m = open_split(tmp / "raw", raw.rows, NUM_DENSE, NUM_CAT, info["ids"])
    ranges = split_ranges(opts, file_rows, raw.rows)

    def blocks(rng):
        for a0, b0 in rng:
            for a in range(a0, b0, BLOCK_ROWS):
                b = min(b0, a + BLOCK_ROWS)
                lengths = np.asarray(m["bag_lengths.u16"][a:b])
                ro = m["row_offsets.i64"]
                vals = np.asarray(m["sparse.i32"][ro[a] : ro[b]]).view(np.uint32)
                feat = np.repeat(np.tile(np.arange(NUM_CAT), b - a), lengths.reshape(-1))
                yield a, b, lengths, vals, feat

    if opts.hash_sizes:
        sizes = list(opts.hash_sizes) * (NUM_CAT if len(opts.hash_sizes) == 1 else 1)
    else:
        seen = [np.zeros(0, np.uint32) for _ in range(NUM_CAT)]
        for _, _, _, vals, feat in blocks(ranges["train"]):
            for k in range(NUM_CAT):
                seen[k] = np.union1d(seen[k], vals[feat == k])
        sizes = [min(HASH_CAP, max(16, 4 * s.shape[0])) for s in seen]
        echo(
            f"hash sizes from the data (4 x distinct values, at most {HASH_CAP:,}): "
            f"{sum(sizes):,} rows in all"
        )
    size_arr = np.array(sizes, np.uint64)
    splits: dict[str, Any] = {}
    for name, rng in ranges.items():
        w = MultiHotWriter(tmp / name)
        for a, b, lengths, vals, feat in blocks(rng):
            ids = (vals.astype(np.uint64) % size_arr[feat]).astype(np.int32)
            w.append(m["dense.f32"][a:b], lengths, ids, m["labels.u8"][a:b])
        splits[name] = w.close()
    m.clear()  # close the maps before the files go
    shutil.rmtree(tmp / "raw")
    seconds = time.perf_counter() - start
    meta = {
        "format_version": FORMAT_VERSION,
        "multi_hot": True,
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_CAT,
        "feature_names": [f"C{k + 1}" for k in range(NUM_CAT)],
        "table_sizes": [int(s) for s in sizes],
        "id_mode": "hash",
        "hash_sizes": [int(s) for s in sizes],
        "splits": splits,
        "split_rule": opts.split,
        "inputs": [str(p) for p in all_inputs],
        "bad_lines": {
            "lines": report.lines,
            "bad": report.bad,
            "counts": report.counts,
            "examples": report.examples,
        },
        "seconds": seconds,
    }
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    swap_into_place(tmp, out)
    echo(
        f"wrote {out} (multi-hot): "
        + ", ".join(f"{k} {v['rows']:,} rows, {v['ids']:,} ids" for k, v in splits.items())
        + f" in {seconds:.1f}s"
    )
    return meta
