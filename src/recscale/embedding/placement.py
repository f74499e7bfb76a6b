"""Where a table's rows live: the storage tier of each table group, and its size.

``placement`` (``config.schema.PLACEMENTS``) per table::

    device   a DeviceStorage in the compute device's memory (CPU RAM or GPU HBM)
    host     a CachedStorage: rows in host memory (pinned under CUDA), a hot-row cache
             on the compute device - a GPU run's tables larger than its memory
    ssd      a CachedStorage: rows in a file, a hot-row cache in memory

A tier keeps fp32 rows; at ``row_precision=split_bf16`` (fp32's bits in two halves) its
lookup pools each value's bf16 high half, as the device's split rows do, so a table
trains the same on every placement. The other row precisions live on the device only.

The planner decides placements (``planner/``); this module only builds storages.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from recscale.config.schema import EmbeddingConfig
from recscale.embedding.cached_storage import TEMP_DIR_PREFIX, CachedStorage
from recscale.embedding.compressed import build_compressed
from recscale.embedding.compressed_group import QRGroupStorage
from recscale.embedding.low_precision import device_rows
from recscale.embedding.sizing import row_bytes


def device_storage_factory(
    cfg: EmbeddingConfig, device: torch.device | None, kernel: str, stack_qr: bool = True
):
    """Storages in the compute device's memory: a compressed table's factors (QR tables
    that stack - fp32 factors, no hot rows - in one :class:`QRGroupStorage` when
    ``stack_qr``), or rows at ``row_precision``. Returns ``make(num_rows, dim, optimizer,
    tables)``; ``make.stacks_qr`` tells a collection whether to group its QR tables."""

    def make(num_rows: int, dim: int, optimizer, tables: list, parts: list | None = None):
        kern = getattr(tables[0], "kernel", "") or kernel  # the plan's choice, when it made one
        if tables[0].compression != "none":  # one compressed table, or stacked QR tables
            members = [
                build_compressed(
                    t.compression, t.num_rows, dim, t.small_dim, cfg, optimizer, device, kern
                )
                for t in tables
            ]
            return members[0] if len(members) == 1 else QRGroupStorage(members)
        if tables[0].placement != "device":
            raise ValueError(
                f"table {tables[0].name} is planned on the {tables[0].placement} tier: build it "
                "through the plan (train.parallel.build), not as a single-device model"
            )
        return device_rows(num_rows, dim, optimizer, cfg.row_precision, device, kern)

    # the factors QRGroupStorage stacks: fp32 rows (a run resolves "auto" before it
    # builds), no hot rows
    make.stacks_qr = stack_qr and cfg.row_precision in ("fp32", "auto") and not cfg.hot_fraction
    return make


RankOfId = Callable[[int], "np.ndarray | None"]


def file_order(parts: list, rank_of_id: RankOfId) -> tuple[np.ndarray | None, list]:
    """A group's file layout from each model table's popularity ranks: ``rank_of_id(f)``
    is a permutation of table f's ids (0 = the most used) or None (id order). Part i of
    the group (rows ``[row_lo, row_hi)`` of its table) keeps its own range of file rows,
    its rows in rank order within it. Returns (position per row or None, the segments
    ``(start, rows)``)."""
    total = sum(p.row_hi - p.row_lo for p in parts)
    # int32 where it fits: a 572M-row group's positions are 2.3 GB, not 4.6
    position = np.empty(total, np.int32 if total < 2**31 else np.int64)
    segments, start, ordered = [], 0, False
    for p in parts:
        n = p.row_hi - p.row_lo
        ranks = rank_of_id(p.feature)
        if ranks is None:
            position[start : start + n] = np.arange(start, start + n)
        else:
            if len(ranks) != p.table_rows:
                raise ValueError(
                    f"the row order of table {p.feature} has {len(ranks):,} ranks, the table "
                    f"{p.table_rows:,} rows"
                )
            r = np.asarray(ranks[p.row_lo : p.row_hi], dtype=np.int64)
            if n != p.table_rows:  # a block of rows: their ranks among themselves
                r = np.argsort(np.argsort(r, kind="stable"), kind="stable")
            position[start : start + n] = start + r
            ordered = True
        segments.append((start, n))
        start += n
    return (position if ordered else None), segments


def storage_factory(
    cfg: EmbeddingConfig,
    device: torch.device | None,
    kernel: str,
    subdir: str = "",
    rank_of_id: RankOfId | None = None,
):
    """What the plan placed where: device tables as :func:`device_storage_factory`; host
    and ssd tables in a :class:`CachedStorage` (ssd: one file per dim under
    ``cfg.ssd_dir``/``subdir`` - each rank its own - or a temp dir when empty) whose cache,
    on ``device``, holds the group's tables' ``cache_bytes``; with ``rank_of_id`` (see
    :func:`file_order`) an ssd file lays its rows out hottest first. Returns
    ``make(num_rows, dim, optimizer, tables, parts)``."""
    root = Path(cfg.ssd_dir) / subdir if cfg.ssd_dir else None
    on_device = device_storage_factory(cfg, device, kernel)

    def make(num_rows: int, dim: int, optimizer, tables: list, parts: list):
        nonlocal root
        if tables[0].compression != "none" or tables[0].placement == "device":
            return on_device(num_rows, dim, optimizer, tables, parts)
        kern = getattr(tables[0], "kernel", "") or kernel  # the plan's choice
        rows = max(1, sum(t.cache_bytes for t in tables) // row_bytes(cfg, dim))
        split = cfg.row_precision == "split_bf16"  # fp32 rows, pooled by their high halves
        if tables[0].placement == "host":  # host memory under a cache on the device (GPU)
            storage = CachedStorage(
                num_rows,
                dim,
                optimizer,
                None,
                rows,
                policy=cfg.cache_policy,
                kernel=kern,
                device=device,
                high_halves=split,
            )
            if rank_of_id is not None:  # the hot head its cache warms and pins
                storage.set_row_order(*file_order(parts, rank_of_id))
            return storage
        if root is None:
            root = Path(tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX))
        storage = CachedStorage(
            num_rows,
            dim,
            optimizer,
            root / f"tables_dim{dim}.f32",
            rows,
            policy=cfg.cache_policy,
            kernel=kern,
            device=device,
            io_depth=cfg.io_depth,
            io_access=cfg.ssd_access,
            high_halves=split,
        )
        if rank_of_id is not None:
            storage.set_row_order(*file_order(parts, rank_of_id))
        return storage

    make.stacks_qr = on_device.stacks_qr
    return make
