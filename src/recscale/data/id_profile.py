"""A dataset's id profile: how often each id of each table occurs in its train split.

``recscale data preprocess`` writes it beside the splits, and ``metadata.json`` names it.
Only the ids that occur are stored, so its size follows the data, not the tables (a
hash size of 2^31 costs nothing)::

    OUT/id_counts.u32   uint32, table after table: the table's k_t ids that occur in the
                        train split (ascending), then their k_t counts (saturating at
                        2^32 - 1)
    metadata.json       "id_profile": {"file": "id_counts.u32", "split": "train",
                                       "rows": N, "ids": [k_0, k_1, ...],
                                       "hit_curves": [[[fraction of rows, share], ...], ...]}

An ssd tier lays its file out by it (``embedding.row_order=frequency``: ids by their
count over the whole train split, then by id; the ids that never occur last), where a
dataset without one counts its first ``embedding.order_sample_rows`` samples at start;
the planner prices an ssd table's misses by its hit curve (``planner/from_config.py``).
A profile the metadata names must be there and agree with it: a missing, short or
foreign one is an error naming the file, never a silent fallback to another order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.columns import DatasetError

PROFILE_FILE = "id_counts.u32"
_MAX = np.iinfo(np.uint32).max
# Where a table's hit curve is read: the share of its rows a cache holds (the planner's
# points; preprocessing stores the profile's curve at these)
CURVE_FRACTIONS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)


def hit_curve(counts: np.ndarray, rows: int) -> list[list[float]]:
    """``[[fraction of rows, share of lookups], ...]`` at :data:`CURVE_FRACTIONS` for a
    table of ``rows`` rows whose ids that occur have ``counts``: the share of lookups a
    cache of that fraction of its rows, the most used ones, serves."""
    c = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    total = int(c.sum())
    if total == 0:
        return []
    top = np.cumsum(c)
    k = [min(c.shape[0], max(1, int(np.ceil(x * rows)))) for x in CURVE_FRACTIONS]
    return [[x, int(top[i - 1]) / total] for x, i in zip(CURVE_FRACTIONS, k)]


def write_id_profile(
    out_dir: Path, tables: list[tuple[np.ndarray, np.ndarray]], sizes: list[int]
) -> dict[str, Any]:
    """Write each table's ``(ids, counts)`` - the ids that occur, ascending, and how often
    - to ``out_dir``; returns the entry for ``metadata.json``'s ``id_profile`` (without
    ``rows``)."""
    with open(Path(out_dir) / PROFILE_FILE, "wb") as f:
        for ids, counts in tables:
            f.write(np.asarray(ids).astype(np.uint32).tobytes())
            f.write(np.minimum(counts, _MAX).astype(np.uint32).tobytes())
    return {
        "file": PROFILE_FILE,
        "split": "train",
        "ids": [int(len(ids)) for ids, _ in tables],
        "hit_curves": [hit_curve(c, n) for (_, c), n in zip(tables, sizes)],
    }


def read_id_profile(
    root: str | Path, meta: dict[str, Any]
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each table's ``(ids, counts)`` (uint32 views of the file's memory map: a table is
    read when it is used), or None when the dataset has no profile; raises
    :class:`DatasetError` naming the file when the metadata names one that is missing,
    unreadable, or does not agree with the tables and the train split."""
    entry = meta.get("id_profile")
    if entry is None:
        return None
    root = Path(root)
    name = entry.get("file") if isinstance(entry, dict) else None
    ks = entry.get("ids") if isinstance(entry, dict) else None
    sizes = [int(n) for n in meta["table_sizes"]]
    if (
        not isinstance(name, str)
        or not name
        or Path(name).name != name
        or not isinstance(ks, list)
        or len(ks) != len(sizes)
        or not all(isinstance(k, int) and 0 <= k <= n for k, n in zip(ks, sizes))
    ):
        raise DatasetError(
            f"{root / 'metadata.json'}: its id_profile entry does not describe this "
            "dataset's tables (a damaged or hand-edited metadata.json)"
        )
    path = root / name
    try:
        have = path.stat().st_size if path.is_file() else None
    except OSError as e:
        raise DatasetError(f"{path}: the dataset's id profile is unreadable ({e})") from None
    if have is None:
        raise DatasetError(
            f"{path}: the id profile metadata.json names is missing (a damaged or partly "
            "copied dataset: copy it whole, or preprocess again)"
        )
    if have != 8 * sum(ks):
        raise DatasetError(
            f"{path}: {have:,} bytes where metadata.json's {sum(ks):,} ids need "
            f"{8 * sum(ks):,}: the profile of another dataset, or a damaged one"
        )
    flat = np.memmap(path, dtype=np.uint32, mode="r") if have else np.zeros(0, np.uint32)
    rows = entry.get("rows")
    tables, at = [], 0
    for t, (k, n) in enumerate(zip(ks, sizes)):
        ids, counts = flat[at : at + k], flat[at + k : at + 2 * k]
        at += 2 * k
        total = int(counts.sum(dtype=np.uint64))
        if k and (int(ids[-1]) >= n or (ids[1:] <= ids[:-1]).any()):
            raise DatasetError(
                f"{path}: table {t}'s ids are not ascending ids of its {n:,} rows: the "
                "profile of another dataset, or a damaged one"
            )
        # one id a table a row: each table counts every row of the split
        if isinstance(rows, int) and total != rows and not (counts == _MAX).any():
            raise DatasetError(
                f"{path}: table {t}'s counts add up to {total:,}, but the train split "
                f"has {rows:,} rows: the profile of another dataset, or a damaged one"
            )
        tables.append((ids, counts))
    return tables
