"""What a table's placement costs each rank a step: the work (plain counts) and the
linear laws that turn work into seconds. The planner minimises these seconds; the
performance model (``recscale.perfmodel``) predicts a step from the same counts, so
the plan it chooses is the one the model predicts fastest.

Work of one table (B global batch, W ranks, p ids per sample, D the dim)::

    kind           on which ranks   ids          values (ids x width)   all-to-all bytes
    data_parallel  every rank       B p / W      B p D / W              0 (all-reduce of the
                                                                          grads: ring bytes)
    table_wise     its owner        B p          B p D                  (B p 8 + 2 B D 4) (W-1)/W
    row_wise       every rank       B p / W      B p D / W              B p 8 / W + 2 B D 4 (W-1)/W
    column_wise    k ranks          B p          B p D / k              (B p 8 + 2 B D/k 4) (W-1)/W

ids travel as 8-byte ints to their shard (input dist), the pooled vectors forward and
their gradients backward as fp32 (output dist); at W = 1 nothing travels.

Seconds (``CostLaws``)::

    embedding   values * per_value + ids * per_id      (lookup + fused sparse update)
    all-to-all  bytes * all_to_all_per_byte             (+ per-call latency, counted per rank)
    all-reduce  bytes * all_reduce_per_byte

Defaults come from a ``Topology``'s bandwidths; a calibration (`recscale bench
calibrate`) replaces them with this machine's measured laws.
"""

from __future__ import annotations

from dataclasses import dataclass

from recscale.planner.types import TableInfo, Topology

ID_BYTES = 8
VALUE_BYTES = 4
# Collectives a training step issues on each rank: the input dist (lengths, ids,
# weights), the output dist forward and backward, the dense all-reduce.
ALL_TO_ALL_CALLS = 5
ALL_REDUCE_CALLS = 1


@dataclass(frozen=True)
class Work:
    """One table's work on one rank in one step."""

    ids: float = 0.0
    values: float = 0.0  # ids x the columns this rank holds
    all_to_all_bytes: float = 0.0
    all_reduce_bytes: float = 0.0

    def __add__(self, o: Work) -> Work:
        return Work(
            self.ids + o.ids,
            self.values + o.values,
            self.all_to_all_bytes + o.all_to_all_bytes,
            self.all_reduce_bytes + o.all_reduce_bytes,
        )


@dataclass(frozen=True)
class CostLaws:
    """Seconds per unit of work (plain numbers: JSON-able, no torch)."""

    per_value: float  # s per id x column: lookup read + update read/write
    per_id: float = 0.0
    all_to_all_per_byte: float = 0.0
    all_reduce_per_byte: float = 0.0
    # Once per rank a step, not per table (a fused call covers all tables; a collective
    # carries all tables' parts): the performance model adds them, the planner needs not.
    embedding_per_call: float = 0.0
    all_to_all_per_call: float = 0.0
    all_reduce_per_call: float = 0.0
    source: str = "topology"  # or the calibration file's machine

    @staticmethod
    def from_topology(t: Topology) -> CostLaws:
        return CostLaws(
            per_value=3.0 * VALUE_BYTES / t.gather_bandwidth,
            all_to_all_per_byte=1.0 / t.all_to_all_bandwidth,
            all_reduce_per_byte=1.0 / t.all_reduce_bandwidth,
        )

    def seconds(self, w: Work) -> float:
        """The per-table part (no per-call constants)."""
        return (
            w.values * self.per_value
            + w.ids * self.per_id
            + w.all_to_all_bytes * self.all_to_all_per_byte
            + w.all_reduce_bytes * self.all_reduce_per_byte
        )


def ring_bytes(nbytes: float, world_size: int) -> float:
    """Bytes a rank sends in a ring all-reduce of ``nbytes``: 2 (W-1)/W of them."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def placement_work(
    t: TableInfo, kind: str, world_size: int, batch: int, width: int | None = None
) -> Work:
    """The work on each rank that holds a part of ``t`` placed as ``kind`` (``width``:
    a column shard's columns)."""
    w, b, p, d = world_size, batch, t.pooling, t.dim
    spread = (w - 1) / w
    if kind == "data_parallel":
        return Work(b * p / w, b * p * d / w, 0.0, ring_bytes(t.rows * d * VALUE_BYTES, w))
    if kind == "table_wise":
        return Work(b * p, b * p * d, (b * p * ID_BYTES + 2 * b * d * VALUE_BYTES) * spread)
    if kind == "row_wise":
        return Work(
            b * p / w, b * p * d / w, b * p * ID_BYTES / w + 2 * b * d * VALUE_BYTES * spread
        )
    if kind == "column_wise":
        c = width if width is not None else d
        return Work(b * p, b * p * c, (b * p * ID_BYTES + 2 * b * c * VALUE_BYTES) * spread)
    raise ValueError(f"unknown sharding kind {kind!r}")


def rank_work(tables: list[TableInfo], plan, batch: int) -> list[Work]:
    """Each rank's total work under ``plan`` (a ``ShardingPlan``, tables in its order)."""
    w = plan.world_size
    out = [Work() for _ in range(w)]
    by_name = {t.name: t for t in tables}
    for pl in plan.placements:
        t = by_name[pl.table]
        for i, r in enumerate(pl.ranks):
            width = pl.dims[i] if pl.dims else None
            out[r] = out[r] + placement_work(t, pl.kind, w, batch, width)
    return out
