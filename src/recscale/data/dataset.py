"""Read a preprocessed binary dataset and turn it into :class:`Batch` es.

No per-sample Python: a batch is a slice of a block of rows read sequentially from
the memory map and permuted in memory.

**Order.** Rows are grouped in blocks of ``block_rows``. With ``shuffle``, epoch e
visits the blocks in a random order and the rows of each block in a random order,
both drawn from ``(seed, e)``: reads stay sequential, and any position of any epoch
can be recomputed, which is what resuming needs.

**Ranks.** Global batch ``i`` is the positions ``[i*B, (i+1)*B)`` of the epoch's order;
rank r of W takes the r-th of W equal slices of it (B must divide by W), so the
ranks together see exactly the batch a single process would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale.data.batch import Batch
from recscale.data.columns import (
    DATASET_FIELDS,
    DatasetError,
    _check_finite,
    check_bags,
    map_column,
    read_metadata,
)
from recscale.data.multihot import BagRule, open_split


class SplitMissing(DatasetError):
    """The dataset is there but has no split of that name (the config's split key is
    what to fix, not the path)."""


class BinaryDataset:
    """One split of a dataset written by ``recscale data preprocess``."""

    def __init__(self, root: str | Path, split: str) -> None:
        self.root = Path(root)
        meta_path = self.root / "metadata.json"
        self.meta: dict[str, Any] = read_metadata(self.root, DATASET_FIELDS)
        if split not in self.meta["splits"]:
            raise SplitMissing(
                f"{self.root} has no split '{split}' (it has {', '.join(self.meta['splits'])})"
            )
        self.split = split
        self.rows = int(self.meta["splits"][split]["rows"])
        self.num_dense = int(self.meta["num_dense"])
        self.num_sparse = int(self.meta["num_sparse"])
        if len(self.table_sizes) != self.num_sparse:
            raise DatasetError(
                f"{meta_path}: {len(self.table_sizes)} table sizes for {self.num_sparse} "
                "categorical columns (a damaged or hand-edited metadata.json)"
            )
        d = self.root / split
        self.multi_hot = bool(self.meta.get("multi_hot"))
        self.bag_rule = None  # multi-hot "rule" layout: bags made from one-hot ids on read
        layout = self.meta.get("multi_hot_layout", "ids") if self.multi_hot else None
        if layout not in (None, "rule", "ids"):
            raise DatasetError(f"{meta_path}: unknown multi_hot_layout {layout!r}")
        if layout == "rule":
            seed = self.meta.get("multi_hot_seed", 0)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise DatasetError(f"{meta_path}: multi_hot_seed is {seed!r}, not a whole number")
            try:
                self.bag_rule = BagRule(self.table_sizes, list(self.meta["bag_sizes"]), seed)
            except (KeyError, TypeError, ValueError) as e:
                raise DatasetError(
                    f"{meta_path}: a rule-layout multi-hot dataset without valid bag_sizes ({e})"
                ) from None
        if layout == "ids":  # variable-length bags (data/multihot.py)
            if "ids" not in self.meta["splits"][split]:
                raise DatasetError(f"{meta_path}: multi-hot split '{split}' without its ids count")
            ids = int(self.meta["splits"][split]["ids"])
            m = open_split(d, self.rows, self.num_dense, self.num_sparse, ids)
            self.dense, self.labels, self.sparse = m["dense.f32"], m["labels.u8"], m["sparse.i32"]
            self.lengths, self.row_offsets = m["bag_lengths.u16"], m["row_offsets.i64"]
            check_bags(d, self.lengths, self.row_offsets, ids)
        else:
            rows, fd, fs = self.rows, self.num_dense, self.num_sparse
            self.dense = map_column(d / "dense.f32", np.float32, (rows, fd))
            self.sparse = map_column(d / "sparse.i32", np.int32, (rows, fs))
            self.labels = map_column(d / "labels.u8", np.uint8, (rows,))
        _check_finite(d / "dense.f32", self.dense)
        if self.rows and int(self.labels.max()) > 1:
            bad = int(np.argmax(self.labels > 1))
            raise DatasetError(
                f"{d / 'labels.u8'}: row {bad} has label {int(self.labels[bad])}; labels are 0 or 1"
            )

    @property
    def table_sizes(self) -> list[int]:
        return list(self.meta["table_sizes"])


@dataclass
class LoaderPosition:
    epoch: int = 0
    batch: int = 0  # global batches already consumed in this epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}


class BatchLoader:
    """Iterate (rank-local) batches; ``position`` says where a resumed run continues."""

    def __init__(
        self,
        dataset: BinaryDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        block_rows: int = 1 << 16,
        epochs: int | None = None,
        position: LoaderPosition | None = None,
    ) -> None:
        if batch_size % world_size:
            raise DatasetError(
                f"global batch {batch_size} does not divide across {world_size} ranks"
            )
        if drop_last and dataset.rows < batch_size:
            raise DatasetError(
                f"split '{dataset.split}' has {dataset.rows} rows, fewer than one batch "
                f"({batch_size})"
            )
        self.ds, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.block_rows, self.epochs = block_rows, epochs
        self.position = position or LoaderPosition()
        self.num_blocks = -(-dataset.rows // block_rows)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.ds.rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _block_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_blocks)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)

    def _read_block(self, epoch: int, k: int):
        lo = k * self.block_rows
        hi = min(self.ds.rows, lo + self.block_rows)
        if self.ds.multi_hot and self.ds.bag_rule is None:
            return self._read_multi_hot(epoch, k, lo, hi)
        # np.array copies: one sequential read of the block into (writable) memory.
        dense, sparse, labels = (
            np.array(a[lo:hi]) for a in (self.ds.dense, self.ds.sparse, self.ds.labels)
        )
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch, k]).permutation(hi - lo)
            dense, sparse, labels = dense[perm], sparse[perm], labels[perm]
        if self.ds.bag_rule is not None:  # multi-hot "rule" layout: the shuffled rows' bags
            return _Rows(dense, labels, *self.ds.bag_rule.bags(sparse))
        return dense, sparse, labels

    def _read_multi_hot(self, epoch: int, k: int, lo: int, hi: int) -> _Rows:
        ds = self.ds
        ro = np.array(ds.row_offsets[lo : hi + 1])
        rows = _Rows(
            np.array(ds.dense[lo:hi]),
            np.array(ds.labels[lo:hi]),
            np.array(ds.lengths[lo:hi]),
            ro[1:] - ro[0],
            np.array(ds.sparse[ro[0] : ro[-1]]),
        )
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch, k]).permutation(hi - lo)
            rows = rows.permuted(perm)
        return rows

    def __iter__(self) -> Iterator[Batch]:
        pos = self.position
        while self.epochs is None or pos.epoch < self.epochs:
            yield from self._epoch(pos)
            pos.epoch, pos.batch = pos.epoch + 1, 0

    def _epoch(self, pos: LoaderPosition) -> Iterator[Batch]:
        b, per_rank = self.batch_size, self.batch_size // self.world_size
        n_batches = self.batches_per_epoch
        skip_rows = pos.batch * b  # resume: rows of the epoch already consumed
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        have = 0
        # Resume: skip whole blocks without reading them, then rows inside the next one.
        order = self._block_order(pos.epoch)
        start_block = 0
        while start_block < len(order) and skip_rows >= self._block_len(int(order[start_block])):
            skip_rows -= self._block_len(int(order[start_block]))
            start_block += 1
        blocks = (self._read_block(pos.epoch, int(k)) for k in order[start_block:])
        while pos.batch < n_batches:
            while have < b + skip_rows:
                block = next(blocks, None)
                if block is None:
                    break
                pending.append(block)
                have += _rows_in(block)
            if skip_rows:
                _, pending = _take_front(pending, skip_rows)
                have -= skip_rows
                skip_rows = 0
            take = min(b, have)
            if take == 0 or (take < b and self.drop_last):
                return
            rows, pending = _take_front(pending, take)
            have -= take
            lo = self.rank * per_rank if take == b else 0
            hi = lo + per_rank if take == b else take
            pos.batch += 1
            if isinstance(rows, _Rows):
                yield rows.cut(hi)[0].cut(lo)[1].to_batch()
            else:
                yield _to_batch(rows[0][lo:hi], rows[1][lo:hi], rows[2][lo:hi])

    def _block_len(self, k: int) -> int:
        return min(self.ds.rows, (k + 1) * self.block_rows) - k * self.block_rows


@dataclass
class _Rows:
    """Multi-hot rows in memory: ``values`` row-major in row order, row i's ids ending at
    ``ends[i]`` (so any run of rows is one contiguous slice of ``values``)."""

    dense: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray  # [n, F] uint16
    ends: np.ndarray  # [n] int64
    values: np.ndarray  # [ends[-1]] int32

    def __len__(self) -> int:
        return self.labels.shape[0]

    def permuted(self, perm: np.ndarray) -> _Rows:
        row_len = np.diff(self.ends, prepend=0)
        starts = (self.ends - row_len)[perm]
        row_len = row_len[perm]
        return _Rows(
            self.dense[perm],
            self.labels[perm],
            self.lengths[perm],
            np.cumsum(row_len),
            self.values[segment_gather(starts, row_len)],
        )

    def cut(self, k: int) -> tuple[_Rows, _Rows]:
        """(the first k rows, the rest)."""
        e = int(self.ends[k - 1]) if k else 0
        front = _Rows(
            self.dense[:k], self.labels[:k], self.lengths[:k], self.ends[:k], self.values[:e]
        )
        rest = _Rows(
            self.dense[k:], self.labels[k:], self.lengths[k:], self.ends[k:] - e, self.values[e:]
        )
        return front, rest

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [p.values.shape[0] for p in parts[:-1]])
        return _Rows(
            *(
                np.concatenate([getattr(p, n) for p in parts])
                for n in ("dense", "labels", "lengths")
            ),
            np.concatenate([p.ends + s for p, s in zip(parts, shift)]),
            np.concatenate([p.values for p in parts]),
        )

    def to_batch(self) -> Batch:
        """Row-major bags -> the feature-major jagged batch."""
        b, f = self.lengths.shape
        lens = self.lengths.astype(np.int64)
        starts_rm = np.concatenate([[0], np.cumsum(lens.reshape(-1))[:-1]]).reshape(b, f)
        lens_fm = np.ascontiguousarray(lens.T).reshape(-1)
        starts_fm = np.ascontiguousarray(starts_rm.T).reshape(-1)
        values = self.values[segment_gather(starts_fm, lens_fm)].astype(np.int64)
        offsets = np.zeros(f * b + 1, np.int64)
        np.cumsum(lens_fm, out=offsets[1:])
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(self.dense)),
            values=torch.from_numpy(values),
            offsets=torch.from_numpy(offsets),
            labels=torch.from_numpy(self.labels.astype(np.float32)),
        )


def segment_gather(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the segments ``[starts[i], starts[i] + lengths[i])``, concatenated."""
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


def _rows_in(blk) -> int:
    return len(blk) if isinstance(blk, _Rows) else blk[0].shape[0]


def _cut(blk, k: int):
    """(the first k rows of a block, the rest): a (dense, sparse, labels) tuple or
    multi-hot ``_Rows``."""
    if isinstance(blk, _Rows):
        return blk.cut(k)
    return tuple(a[:k] for a in blk), tuple(a[k:] for a in blk)


def _take_front(pending, n):
    """Take the first n rows off a list of blocks; returns (the rows, the rest)."""
    taken, rest, need = [], [], n
    for blk in pending:
        m = _rows_in(blk)
        if need >= m:
            taken.append(blk)
            need -= m
        elif need > 0:
            front, back = _cut(blk, need)
            taken.append(front)
            rest.append(back)
            need = 0
        else:
            rest.append(blk)
    if isinstance(taken[0], _Rows):
        return _Rows.concat(taken), rest
    cols = tuple(
        np.concatenate([t[i] for t in taken]) if len(taken) > 1 else taken[0][i] for i in range(3)
    )
    return cols, rest


def _to_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    """Row-major ``sparse [B, F]`` -> feature-major jagged values with one id per bag."""
    b, f = sparse.shape
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(dense)),
        values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1).astype(np.int64)),
        offsets=torch.arange(f * b + 1, dtype=torch.int64),
        labels=torch.from_numpy(labels.astype(np.float32)),
    )
