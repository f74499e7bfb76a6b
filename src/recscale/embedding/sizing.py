"""Bytes of the embedding tables, one place for every tier, the planner and the reports:
a row at ``row_precision`` with its optimizer state, a compressed table's factors, the
whole model's tables against plain fp32 ones.

    plain row      dim * bytes_per_value(row_precision) + row_overhead (int8: scale, bias)
                   + state_bytes (row-wise Adagrad 4; Adam 8 * dim; SGD 0)
    compressed     its factors at row_precision (whole projections fp32), their state,
                   and the exact hot rows (``compressed_table_bytes``)
"""

from __future__ import annotations

import math

from recscale.config.schema import Config, EmbeddingConfig
from recscale.embedding.compression_shapes import (
    factor_precision,
    factor_shapes,
    hot_count,
    hot_id_bytes,
    table_compressions,
)

# A tier's table part is drawn whole (to be written in file order) up to this many fp32
# values, 4 GB; a larger one a chunk at a time. Memory beside the cache at initialization.
INIT_DRAW_MAX_VALUES = 1 << 30


# Memory beyond the rows themselves, for sizing a cache from free memory: per cache slot
# score (8) + row_of_slot (8) + its free-stack entry (8) + dirty and pinned flags (2);
# per table row slot_of_row (4) + its file position (4) (``cached_storage.py``).
SLOT_OVERHEAD_BYTES = 26
ROW_INDEX_BYTES = 8


def bytes_per_value(precision: str) -> float:
    """Stored bytes of one row element (int8 adds 8 bytes a row: see ``row_overhead``).
    ``auto`` is fp32 or split_bf16 (what a run makes of it): four bytes either way."""
    return {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "split_bf16": 4, "auto": 4}[precision]


def lookup_bytes_per_value(precision: str) -> float:
    """Bytes of one row element a lookup reads: as stored, but split_bf16's lookup reads
    the bf16 high halves only (its update reads and writes both)."""
    return 2 if precision == "split_bf16" else bytes_per_value(precision)


def row_overhead(precision: str) -> int:
    """Bytes a row carries beside its values (int8: its scale and bias)."""
    return 8 if precision == "int8" else 0


def table_bytes(num_rows: int, dim: int, precision: str) -> int:
    """Stored bytes of a table's rows (no optimizer state)."""
    return int(num_rows * (dim * bytes_per_value(precision) + row_overhead(precision)))


def optimizer_state_shapes(optimizer: str, dim: int) -> dict[str, tuple[int, ...]]:
    """A sparse optimizer's per-row state (``embedding.optimizer``): name -> trailing
    shape, ``()`` one fp32 value a row. The optimizers allocate it; sizes count it."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {
        "sgd": {},
        "rowwise_adagrad": {"sum": ()},
        "adam": {"exp_avg": (dim,), "exp_avg_sq": (dim,)},
    }
    if optimizer not in shapes:
        raise ValueError(f"unknown sparse optimizer {optimizer!r} (choices: {', '.join(shapes)})")
    return shapes[optimizer]


def state_bytes(cfg: EmbeddingConfig, dim: int) -> int:
    """Bytes of one row's optimizer state (fp32)."""
    shapes = optimizer_state_shapes(cfg.optimizer, dim).values()
    return 4 * sum(max(1, math.prod(s)) for s in shapes)


def row_bytes(cfg: EmbeddingConfig, dim: int) -> int:
    """Bytes of one row with its optimizer state, at ``cfg.row_precision``."""
    p = cfg.row_precision
    return int(dim * bytes_per_value(p)) + row_overhead(p) + state_bytes(cfg, dim)


def table_memory(cfg: Config) -> dict[str, int]:
    """Bytes of the embedding tables as configured and as plain fp32 tables with the same
    optimizer: ``weights`` / ``plain_weights`` (the rows alone) and ``total`` /
    ``plain_total`` (with optimizer state, what training holds)."""
    e, m = cfg.embedding, cfg.model
    comp = table_compressions(m.table_sizes, m.dims(), e)
    out = dict.fromkeys(("weights", "total", "plain_weights", "plain_total"), 0)
    for (rows, dim), (method, small_dim) in zip(zip(m.table_sizes, m.dims()), comp):
        total, weights = compressed_table_bytes(method, rows, dim, small_dim, e)
        if method == "none":
            row = dim * bytes_per_value(e.row_precision) + row_overhead(e.row_precision)
            total, weights = rows * (row + state_bytes(e, dim)), rows * row
        out["weights"] += weights
        out["total"] += total
        out["plain_weights"] += rows * dim * 4
        out["plain_total"] += rows * (dim * 4 + state_bytes(e, dim))
    return out


def compressed_table_bytes(method: str, rows: int, dim: int, small_dim: int, e) -> tuple[int, int]:
    """A compressed table's bytes in training and of its weights alone: the factors a
    lookup gathers rows of at ``row_precision`` (int8: + scale and bias a row), whole
    factors (mixed_dim's projection) in fp32, plus the optimizer state (row-wise: one
    fp32 value per factor row; Adam: two per factor value) and the hot rows kept exact
    (``embedding.hot_fraction``: rows, ids, state). ``(0, 0)`` for a plain table."""
    if method == "none":
        return 0, 0
    shapes = factor_shapes(method, rows, dim, e.qr_buckets, e.qr_op, e.tt_rank, small_dim)
    k = hot_count(rows, e.hot_fraction)  # exact hot rows: rows at row_precision + an id
    if k:
        shapes = {**shapes, "hot": (k, dim)}
    weights = sum(
        table_bytes(r, w, factor_precision(name, e.row_precision))
        for name, (r, w) in shapes.items()
    )
    weights += k * hot_id_bytes(rows, k)
    values = sum(r * w for r, w in shapes.values())
    if e.optimizer == "adam":
        return weights + 2 * 4 * values, weights
    state = 4 if e.optimizer == "rowwise_adagrad" else 0
    return weights + state * sum(r for r, _ in shapes.values()), weights


def compression_summary(cfg) -> list[str]:
    """What ``embedding.compression`` / ``row_precision`` make of the tables (``cfg``: the
    root ``Config``), a line each - printed at the start of training and by ``plan``."""
    e, m = cfg.embedding, cfg.model
    lines = []
    comp = table_compressions(m.table_sizes, m.dims(), e)
    plain = all(c == "none" for c, _ in comp)
    if e.row_precision not in ("fp32", "auto"):  # auto: fp32 or split_bf16, both 4 bytes
        what = "embedding rows" if plain else "rows and gathered factors"
        how = (
            "Split-SGD-BF16: lookups read the bf16 high halves, updates the exact fp32 value"
            if e.row_precision == "split_bf16"
            else "optimizer state fp32"
        )
        lines.append(f"{what} stored as {e.row_precision} ({how})")
    if plain:  # split_bf16 holds fp32's bytes: no memory line to add
        return [*lines, memory_line(cfg)] if bytes_per_value(e.row_precision) < 4 else lines
    parts = []
    for i, (c, sd) in enumerate(comp):
        if c != "none":
            what = {"qr": f"qr/{e.qr_buckets}", "tt": f"tt r{e.tt_rank}", "mixed_dim": f"dim {sd}"}[
                c
            ]
            parts.append(f"C{i + 1} {what}")
    lines.append(f"compressed tables ({len(parts)} of {len(comp)}): {', '.join(parts)}")
    lines.append(memory_line(cfg))
    return lines


def memory_line(cfg) -> str:
    """The tables' bytes against plain fp32 tables, weights alone and in training."""
    mem = table_memory(cfg)
    return (
        f"tables: weights {mem['weights'] / 1e6:.2f} MB, "
        f"{mem['plain_weights'] / max(mem['weights'], 1):.1f}x smaller than plain fp32; "
        f"with optimizer state {mem['total'] / 1e6:.2f} MB, "
        f"{mem['plain_total'] / max(mem['total'], 1):.1f}x"
    )
