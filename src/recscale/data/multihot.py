"""Multi-hot binary datasets: variable-length bags per feature, and ``recscale data
multihot`` (a one-hot dataset -> MLPerf DLRMv2-style multi-hot).

A multi-hot split (``metadata.json``: ``"multi_hot": true``) has one of two layouts
(``"multi_hot_layout"``; absent = ``ids``). ``ids`` - what ``recscale data preprocess``
writes from Parquet list columns, and ``recscale data multihot --layout ids`` - is, for
R rows, F sparse features and N ids in all::

    dense.f32        [R, F_dense] float32, row-major
    labels.u8        [R] uint8
    bag_lengths.u16  [R, F]   ids in the bag of (row, feature); 0 = empty bag
    row_offsets.i64  [R + 1]  row r's ids are sparse.i32[row_offsets[r]:row_offsets[r+1]]
    sparse.i32       [N]      row-major: row r's bag of feature 0, then feature 1, ...

so a block of rows is one sequential read of each file (the loader's contract), and
``row_offsets`` lets a reader start at any row (resume, rank slices).

``rule`` - ``recscale data multihot``'s default - stores what the bags are made from:
the one-hot split's ``dense.f32``, ``labels.u8`` and ``sparse.i32 [R, F]``, with
``bag_sizes`` and ``multi_hot_seed`` in ``metadata.json``; the loader expands each block
as it reads it (``BagRule``), giving the batches an ``ids`` split of the same sizes and
seed gives. At MLPerf's sizes (214 ids a row) that is 157 bytes a row instead of 969:
6x less to write, to store and to read, for ~0.5 us of one core a row in the loader.

**Expansion** (``expand``): the bag of feature f for a one-hot id x has ``k_f`` ids::

    bag(x) = [x] + [(x + (u_j(x) * rows_f >> 32)) mod rows_f for j in 1..k_f-1]
    u_j(x) = the high 32 bits of the j-th step of an LCG seeded by mix(x * phi ^ salt_f)

(``mix``: splitmix64's finalizer; ``salt_f`` from ``seed`` and f; ``bag_of`` is the
plain-Python statement of it). The first id is the original one, the same x always
gets the same bag (a deterministic function of the data, the sizes and the seed), and
popular ids keep popular bags - as in MLPerf's synthetic multi-hot Criteo, built here
from scratch. Pure arithmetic (no table to look up): ~2 ns an id on one core.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recscale.data.columns import map_column
from recscale.kernels import numba as nb

MAX_BAG = np.iinfo(np.uint16).max
# MLPerf Training DLRMv2 (DCNv2, Criteo 1TB multi-hot): ids per bag of C1..C26, from the
# reference's dataset materialisation (mlcommons/training, recommendation_v2).
MLPERF_BAG_SIZES = (
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
)
BLOCK_ROWS = 1 << 18
LAYOUTS = ("rule", "ids")
FILES = ("dense.f32", "labels.u8", "bag_lengths.u16", "row_offsets.i64", "sparse.i32")


def open_split(d: Path, rows: int, num_dense: int, num_sparse: int, ids: int):
    """Memory maps of a multi-hot split: (dense, labels, lengths, row_offsets, values)."""
    shapes = {
        "dense.f32": (np.float32, (rows, num_dense)),
        "labels.u8": (np.uint8, (rows,)),
        "bag_lengths.u16": (np.uint16, (rows, num_sparse)),
        "row_offsets.i64": (np.int64, (rows + 1,)),
        "sparse.i32": (np.int32, (ids,)),
    }
    return {n: map_column(d / n, dt, shape) for n, (dt, shape) in shapes.items()}


_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer
_GOLDEN = 0x9E3779B97F4A7C15
_LCG_A, _LCG_C = 6364136223846793005, 1442695040888963407  # Knuth's MMIX LCG
_M64 = (1 << 64) - 1


def feature_salts(num_features: int, seed: int) -> np.ndarray:
    """One 64-bit salt per feature from ``seed`` (``uint64 [F]``)."""
    return np.array(
        [_mix(((seed & _M64) * 1_000_003 + f + 1) * _GOLDEN & _M64) for f in range(num_features)],
        np.uint64,
    )


def _mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (the kernel's, for the reference)."""
    z = (z ^ (z >> 30)) * _MIX1 & _M64
    z = (z ^ (z >> 27)) * _MIX2 & _M64
    return z ^ (z >> 31)


def bag_of(x: int, f: int, k: int, rows: int, salts: np.ndarray) -> list[int]:
    """Plain-Python bag of id ``x`` of feature ``f`` (the reference the kernel matches)."""
    s = _mix((x * _GOLDEN & _M64) ^ int(salts[f]))
    out = [x]
    for _ in range(1, k):
        s = (s * _LCG_A + _LCG_C) & _M64
        out.append((x + (((s >> 32) * rows) >> 32)) % rows)
    return out


@nb.njit(cache=True, nogil=True, inline="always")
def _expand_row(ids, r, sizes, bag, salts, out, pos):  # pragma: no cover
    golden, m1, m2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)
    lcg_a, lcg_c = np.uint64(_LCG_A), np.uint64(_LCG_C)
    s30, s27, s31, s32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
    for f in range(ids.shape[1]):
        x = ids[r, f]
        out[pos] = x
        pos += 1
        k = bag[f]
        if k == 1:
            continue
        rows = np.uint64(sizes[f])
        z = (np.uint64(x) * golden) ^ salts[f]
        z = (z ^ (z >> s30)) * m1
        z = (z ^ (z >> s27)) * m2
        s = z ^ (z >> s31)
        for _ in range(1, k):
            s = s * lcg_a + lcg_c
            y = np.uint64(x) + (((s >> s32) * rows) >> s32)
            if y >= rows:
                y -= rows
            out[pos] = np.int32(y)
            pos += 1


@nb.njit(parallel=True, cache=True, nogil=True)
def _expand_kernel(ids, sizes, bag, salts, out):  # pragma: no cover
    n = ids.shape[0]
    per_row = out.shape[0] // max(n, 1)
    for r in nb.prange(n):
        _expand_row(ids, r, sizes, bag, salts, out, r * per_row)


# One thread: what the loader's reader thread calls (numba's workqueue threading layer,
# kernels.py, must not be entered from two threads, and the training step owns the cores).
@nb.njit(cache=True, nogil=True)
def _expand_kernel_serial(ids, sizes, bag, salts, out):  # pragma: no cover
    n = ids.shape[0]
    per_row = out.shape[0] // max(n, 1)
    for r in range(n):
        _expand_row(ids, r, sizes, bag, salts, out, r * per_row)


def expand(ids: np.ndarray, table_sizes: list[int], bag_sizes: list[int], seed: int) -> np.ndarray:
    """One-hot ``ids [n, F]`` -> row-major multi-hot values (``sum(bag_sizes)`` a row)."""
    out = np.empty(ids.shape[0] * sum(bag_sizes), np.int32)
    _expand_kernel(
        np.ascontiguousarray(ids, np.int32),
        np.array(table_sizes, np.int64),
        np.array(bag_sizes, np.int64),
        feature_salts(len(bag_sizes), seed),
        out,
    )
    return out


class BagRule:
    """The bags of a ``rule``-layout split, made as its rows are read: the split keeps the
    one-hot ids, ``metadata.json`` the sizes and the seed (``bag_sizes``,
    ``multi_hot_seed``), and ``bags`` expands a block on one thread (``expand``'s ids)."""

    def __init__(self, table_sizes: list[int], bag_sizes: list[int], seed: int) -> None:
        whole = all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in bag_sizes)
        if (
            len(bag_sizes) != len(table_sizes)
            or not whole
            or not all(1 <= b <= MAX_BAG for b in bag_sizes)
        ):
            raise ValueError(
                f"bag sizes {bag_sizes} for {len(table_sizes)} tables (whole numbers in "
                f"1..{MAX_BAG}, one a table)"
            )
        self.sizes = np.array(table_sizes, np.int64)
        self.bag = np.array(bag_sizes, np.int64)
        self.salts = feature_salts(len(bag_sizes), seed)
        self.per_row = int(self.bag.sum())

    def bags(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One-hot ``ids [n, F]`` -> (lengths ``[n, F]`` uint16, row ends ``[n]`` int64,
        row-major values int32) - what an ``ids``-layout split stores for those rows."""
        n = ids.shape[0]
        values = np.empty(n * self.per_row, np.int32)
        _expand_kernel_serial(
            np.ascontiguousarray(ids, np.int32), self.sizes, self.bag, self.salts, values
        )
        lengths = np.broadcast_to(self.bag.astype(np.uint16), (n, self.bag.shape[0])).copy()
        ends = np.arange(1, n + 1, dtype=np.int64) * self.per_row
        return lengths, ends, values
