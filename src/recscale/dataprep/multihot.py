"""``recscale data multihot``: a one-hot dataset -> a multi-hot one (the layouts and the
expansion are described in ``recscale.data.multihot``, the read side), and the writer
of multi-hot splits that the multi-hot Parquet preprocessor uses too."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.columns import DATASET_FIELDS, DatasetError, read_metadata
from recscale.data.dataset import BinaryDataset
from recscale.data.multihot import BLOCK_ROWS, FILES, LAYOUTS, MAX_BAG, expand
from recscale.dataprep.common import (
    check_free_space,
    check_output_dir,
    fresh_tmp_dir,
    swap_into_place,
    writing,
)


class MultiHotWriter:
    """Append blocks of rows to one multi-hot split directory."""

    def __init__(self, split_dir: Path) -> None:
        split_dir.mkdir(parents=True, exist_ok=True)
        self.dir = split_dir
        self.f = {n: open(split_dir / n, "wb") for n in FILES}
        self.f["row_offsets.i64"].write(np.zeros(1, np.int64).tobytes())
        self.rows = 0
        self.ids = 0
        self.clicks = 0

    def append(
        self, dense: np.ndarray, lengths: np.ndarray, values: np.ndarray, labels: np.ndarray
    ) -> None:
        """``lengths [n, F]``, ``values`` row-major (``lengths.sum()`` ids)."""
        n = lengths.shape[0]
        if n == 0:  # a block whose rows were all bad: nothing to write (a memoryview of
            return  # zero bytes cannot be cast, and had stopped the run)
        if int(lengths.max(initial=0)) > MAX_BAG:
            raise ValueError(f"a bag holds {int(lengths.max())} ids; at most {MAX_BAG}")
        ends = self.ids + np.cumsum(lengths.sum(axis=1, dtype=np.int64))
        if (ends[-1] if n else self.ids) - self.ids != values.shape[0]:
            raise ValueError(f"{values.shape[0]} ids for bags that hold {int(lengths.sum())}")
        # memoryviews: a contiguous array goes to the file without a copy (tobytes made one
        # of every block - a third of `recscale data multihot`'s time)
        for name, a, dt in (
            ("dense.f32", dense, np.float32),
            ("labels.u8", labels, np.uint8),
            ("bag_lengths.u16", lengths, np.uint16),
            ("row_offsets.i64", ends, np.int64),
            ("sparse.i32", values, np.int32),
        ):
            self.f[name].write(memoryview(np.ascontiguousarray(a, dt)).cast("B"))
        self.rows += n
        self.ids += values.shape[0]
        self.clicks += int(np.asarray(labels).sum(dtype=np.int64))

    def close(self) -> dict[str, Any]:
        for f in self.f.values():
            f.close()
        return {
            "rows": self.rows,
            "ids": self.ids,
            "ctr": self.clicks / self.rows if self.rows else None,
        }


def to_multihot(
    src: Path,
    out: Path,
    bag_sizes: list[int],
    seed: int = 0,
    layout: str = "rule",
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``recscale data multihot``: the one-hot dataset ``src`` as a multi-hot one, written
    under ``OUT.tmp`` and renamed into place.

    ``layout="rule"`` keeps the one-hot columns and writes the expansion (sizes, seed) to
    ``metadata.json``; the loader makes the bags as it reads (``BagRule``: the same ids,
    in the same order, as ``ids``). ``layout="ids"`` writes every id of every bag
    (``expand``; at MLPerf's sizes 0.97 KB a row against the rule's 0.16 KB, so it runs
    at the speed the disk takes the bytes)."""
    if layout not in LAYOUTS:
        raise ValueError(f"--layout takes one of {', '.join(LAYOUTS)}, got {layout!r}")
    meta = read_metadata(src, DATASET_FIELDS)
    if meta.get("multi_hot"):
        raise DatasetError(f"{src} is multi-hot already; give a one-hot dataset")
    f = int(meta["num_sparse"])
    given = ",".join(map(str, bag_sizes))  # as typed, not expanded to a size a feature
    if len(bag_sizes) == 1:
        bag_sizes = bag_sizes * f
    if len(bag_sizes) != f or min(bag_sizes) < 1 or max(bag_sizes) > MAX_BAG:
        raise ValueError(f"--bag-sizes takes 1 or {f} sizes in 1..{MAX_BAG}, got {given}")
    check_output_dir(Path(out), [Path(src)])
    with writing(Path(out)):
        return _write(src, Path(out), meta, bag_sizes, seed, layout, echo)


def _write(src, out, meta, bag_sizes, seed, layout, echo) -> dict[str, Any]:
    rows = sum(int(s["rows"]) for s in meta["splits"].values())
    f, dense = int(meta["num_sparse"]), int(meta["num_dense"])
    per_row = 4 * dense + 1 + (4 * f if layout == "rule" else 2 * f + 8 + 4 * sum(bag_sizes))
    check_free_space(out, rows * per_row, f"multihot ({layout} layout, {rows:,} rows)", echo)
    tmp = fresh_tmp_dir(Path(out))
    sizes = [int(s) for s in meta["table_sizes"]]
    start = time.perf_counter()
    splits = {}
    for name in meta["splits"]:
        ds = BinaryDataset(src, name)
        splits[name] = (
            _write_rule(ds, tmp / name, sum(bag_sizes))
            if layout == "rule"
            else _write_ids(ds, tmp / name, sizes, bag_sizes, seed)
        )
    total = sum(s["rows"] for s in splits.values())
    seconds = time.perf_counter() - start
    # the one-hot ids' profile does not count the bags' ids: the tier counts samples
    new = {
        **{k: v for k, v in meta.items() if k != "id_profile"},
        "multi_hot": True,
        "multi_hot_layout": layout,
        "bag_sizes": bag_sizes,
        "multi_hot_seed": seed,
        "multi_hot_source": str(src),
        "splits": splits,
        "seconds": seconds,
    }
    (tmp / "metadata.json").write_text(json.dumps(new, indent=2) + "\n")
    swap_into_place(tmp, Path(out))
    echo(
        f"wrote {out} ({layout} layout): {total:,} rows, {sum(bag_sizes)} ids a row, in "
        f"{seconds:.2f} s ({total / max(seconds, 1e-9) / 1e6:.2f}M rows/s)"
    )
    return new


def _write_rule(ds, split_dir: Path, ids_per_row: int) -> dict:
    """The one-hot columns, copied (the kernel's copy_file_range: no trip through Python);
    the split's rows and CTR are the source's."""
    split_dir.mkdir(parents=True)
    src_dir = ds.root / ds.split
    for name in ("dense.f32", "labels.u8", "sparse.i32"):
        shutil.copyfile(src_dir / name, split_dir / name)
    return {**ds.meta["splits"][ds.split], "ids": ds.rows * ids_per_row}


def _write_ids(ds, split_dir: Path, sizes: list[int], bag_sizes: list[int], seed: int) -> dict:
    """Every bag's ids. One writer thread: block i goes to the files while block i+1
    expands (the kernel runs without the GIL, file writes release it)."""
    f = len(bag_sizes)
    lengths_block = np.broadcast_to(np.array(bag_sizes, np.uint16), (BLOCK_ROWS, f)).copy()
    w = MultiHotWriter(split_dir)
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for a in range(0, ds.rows, BLOCK_ROWS):
            b = min(ds.rows, a + BLOCK_ROWS)
            values = expand(np.asarray(ds.sparse[a:b]), sizes, bag_sizes, seed)
            if pending is not None:
                pending.result()
            pending = pool.submit(
                w.append, ds.dense[a:b], lengths_block[: b - a], values, ds.labels[a:b]
            )
        if pending is not None:
            pending.result()
    return w.close()
