"""The files of a preprocessed dataset, opened checked: ``metadata.json`` and each column
as a read-only memory map of the shape the metadata gives it (a wrong size is a
truncated copy, another dataset's file or another dtype, named with what to do)."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import numpy as np

from recscale.config.small_files import loads_json


class DatasetError(ValueError):
    pass


_CHECKED: set[tuple] = set()  # (file, size, mtime[, what]): the checks a file passed


def _check_finite(path: Path, dense: np.ndarray, chunk_rows: int = 1 << 20) -> None:
    """Raise naming the first row whose dense features hold NaN or inf (they would turn
    every metric into NaN). Once per file version per process: a scan reads the file."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _CHECKED:
        return
    for lo in range(0, dense.shape[0], chunk_rows):
        block = np.asarray(dense[lo : lo + chunk_rows])
        ok = np.isfinite(block).all(axis=1)
        if not ok.all():
            row = lo + int(np.argmin(ok))
            raise DatasetError(
                f"{path}: row {row} has a non-finite dense value ({block[row - lo].tolist()})"
            )
    _CHECKED.add(key)


# What a reader of the rows needs: a metadata.json without one of these is not a dataset
# that ``recscale data`` wrote (the planner reads a partial one for its id frequencies).
DATASET_FIELDS = ("num_dense", "num_sparse", "table_sizes", "splits")


def _not_a_dataset(root: str | Path) -> str:
    """Why ``root`` (no metadata.json) is not a dataset, and what to name instead: a
    path inside one (a split's folder or file) names that dataset, a file elsewhere the
    command that makes one of it."""
    p = Path(root)
    if not p.exists():
        return f"{root} is not a recscale dataset: there is no such file or directory"
    for up in (p.parent, p.parent.parent):
        if (up / "metadata.json").is_file():
            return f"{root} is not a recscale dataset but part of one: name {up}"
    if p.is_file():
        return (
            f"{root} is not a recscale dataset but a file: `recscale data preprocess "
            f"--input {root} --out DIR` makes one of it"
        )
    return f"{root} is not a recscale dataset (no metadata.json)"


def read_metadata(root: str | Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataset's ``metadata.json``; a directory without one is not a dataset. Each
    field of ``required`` (e.g. :data:`DATASET_FIELDS`) must be there."""
    path = Path(root) / "metadata.json"
    if not path.exists():
        raise DatasetError(_not_a_dataset(root))
    st = path.stat()
    if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 20:  # a FIFO would hang the read
        raise DatasetError(f"{path}: not a regular file of a dataset's metadata; refused")
    try:
        meta = loads_json(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise DatasetError(f"{path}: not a dataset's metadata (a JSON object)")
    check_metadata_fields(path, meta)
    missing = [f for f in required if f not in meta]
    if missing:
        raise DatasetError(
            f"{path}: no {', '.join(missing)} (not the metadata of a dataset that "
            "`recscale data preprocess` wrote)"
        )
    return meta


# The dataset layout this code reads (dataprep/common.py FORMAT_VERSION writes it).
READ_FORMAT_VERSION = 1
ID_LIMIT = 2**31  # ids are stored as int32: a table has at most this many rows


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_metadata_fields(path: Path, meta: dict[str, Any]) -> None:
    """Raise naming the field of ``metadata.json`` (at ``path``) that no dataset written by
    ``recscale data`` holds: another format version, counts that are not whole numbers
    >= 0, table sizes outside [1, 2^31) (ids are int32), feature names that are not one
    string a categorical column, splits without a row count."""

    def bad(field: str, why: str) -> DatasetError:
        return DatasetError(
            f"{path}: {field} {why} (a damaged, hand-edited or foreign metadata.json)"
        )

    version = meta.get("format_version", READ_FORMAT_VERSION)
    if not _whole(version) or version < 1:
        raise bad("format_version", f"is {version!r}, not a version number")
    if version > READ_FORMAT_VERSION:
        raise DatasetError(
            f"{path}: format_version {version} is newer than this recscale reads "
            f"({READ_FORMAT_VERSION}): upgrade recscale, or rewrite the dataset with this one"
        )
    for field in ("num_dense", "num_sparse"):
        if field in meta and (not _whole(meta[field]) or meta[field] < 0):
            raise bad(field, f"is {meta[field]!r}, not a whole number >= 0")
    sizes = meta.get("table_sizes")
    if sizes is not None:
        if not isinstance(sizes, list):
            raise bad("table_sizes", "is not a list")
        for i, n in enumerate(sizes):
            if not _whole(n) or not 1 <= n <= ID_LIMIT:
                raise bad(f"table_sizes[{i}]", f"is {n!r}, not a row count in [1, 2^31]")
    names = meta.get("feature_names")
    if names is not None and (
        not isinstance(names, list)
        or not all(isinstance(x, str) for x in names)
        or (_whole(meta.get("num_sparse")) and len(names) != meta["num_sparse"])
    ):
        raise bad("feature_names", "is not one name (a string) a categorical column")
    splits = meta.get("splits")
    if splits is not None:
        if not isinstance(splits, dict):
            raise bad("splits", "is not an object of splits")
        for name, split in splits.items():
            # a split is a directory of the dataset: "../x" would read another's files
            if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise bad(f"splits.{name}", "is not a plain name (a directory of the dataset)")
            rows = split.get("rows") if isinstance(split, dict) else None
            if not _whole(rows) or rows < 0:
                raise bad(f"splits.{name}.rows", f"is {rows!r}, not a whole number >= 0")
            ids = split.get("ids", 0)  # a multi-hot split's id count (data/multihot.py)
            if not _whole(ids) or ids < 0:
                raise bad(f"splits.{name}.ids", f"is {ids!r}, not a whole number >= 0")


def map_column(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only memory map of a column file, checked against the shape metadata.json
    gives it first: a wrong size means a truncated copy, another dataset's file or
    another dtype (float64 dense)."""
    item = np.dtype(dtype).itemsize
    want = int(np.prod(shape)) * item
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise DatasetError(
            f"{path}: a symbolic link or not a regular file; a dataset's columns are its own "
            "files (copy the file in, or rewrite the dataset)"
        )
    have = path.stat().st_size if path.exists() else None
    if have != want:
        raise DatasetError(
            f"{path}: {'missing' if have is None else f'{have:,} bytes'}, but metadata.json "
            f"({' x '.join(f'{n:,}' for n in shape)} x {item} bytes) needs {want:,}: rewrite "
            "the dataset (`recscale data preprocess`)"
        )
    if want == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype, "r", shape=shape)


def check_bags(
    d: Path, lengths: np.ndarray, row_offsets: np.ndarray, ids: int, chunk_rows: int = 1 << 20
) -> None:
    """Raise naming the first row of a multi-hot split whose bags do not add up: the row
    offsets must start at 0, end at the split's id count and step by each row's bag
    lengths (damaged ones would hand ids to the wrong feature). Once per file version."""
    path = d / "row_offsets.i64"
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, "bags")
    if key in _CHECKED:
        return
    rows = lengths.shape[0]
    if int(row_offsets[0]) != 0 or int(row_offsets[rows]) != ids:
        raise DatasetError(
            f"{path}: runs from {int(row_offsets[0])} to {int(row_offsets[rows])}, but the "
            f"split holds {ids:,} ids (metadata.json): rewrite the dataset"
        )
    for lo in range(0, rows, chunk_rows):
        hi = min(rows, lo + chunk_rows)
        per_row = np.asarray(lengths[lo:hi]).sum(axis=1, dtype=np.int64)
        steps = np.diff(np.asarray(row_offsets[lo : hi + 1]))
        bad = np.nonzero(per_row != steps)[0]
        if bad.size:
            r = lo + int(bad[0])
            raise DatasetError(
                f"{d}: row {r}'s bag lengths (bag_lengths.u16) add up to {int(per_row[bad[0]])} "
                f"ids but row_offsets.i64 gives it {int(steps[bad[0]])}: rewrite the dataset"
            )
    _CHECKED.add(key)
