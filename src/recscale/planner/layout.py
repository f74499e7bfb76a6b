"""From a sharding plan to shards: which rank holds which rows and columns of which table.

A :class:`Shard` is a rectangle of one table, ``rows [row_lo, row_hi) x cols
[col_lo, col_hi)``, owned by one rank::

    table_wise   one shard:     all rows, all columns, on ranks[0]
    row_wise     one per rank:  rows split in contiguous blocks (sizes differ by <= 1)
    column_wise  one per rank:  all rows, columns split by the plan's ``dims``
    data_parallel no shards:    every rank holds the whole table (``dp_features``)

On its owner, the shards form the tables of one
:class:`~recscale.modules.EmbeddingBagCollection` (the compute stage), in global
shard order: the order both all-to-alls use, so sender and receiver agree without
telling each other. The layout is a pure function of (tables, plan), identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from recscale.planner.types import KINDS, ShardingPlan, TablePlacement


@dataclass(frozen=True)
class Shard:
    index: int  # global position: features in order, then the placement's ranks in order
    feature: int
    kind: str
    owner: int
    row_lo: int
    row_hi: int
    col_lo: int
    col_hi: int

    @property
    def width(self) -> int:
        return self.col_hi - self.col_lo

    @property
    def num_rows(self) -> int:
        return self.row_hi - self.row_lo


@dataclass
class RankShards:
    """One rank's shards, in wire order (global shard index)."""

    shards: list[Shard] = field(default_factory=list)


@dataclass
class ShardLayout:
    num_rows: list[int]  # per feature
    dims: list[int]  # per feature
    shards: list[Shard]  # global order
    dp_features: list[int]
    per_rank: list[RankShards]

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    @property
    def is_identity(self) -> bool:
        """One rank holding every table whole, in table order: both distribution stages
        have nothing to do (world size 1, the single-process run)."""
        return (
            self.world_size == 1
            and not self.dp_features
            and [(s.feature, s.row_lo, s.row_hi, s.col_lo, s.col_hi) for s in self.shards]
            == [(f, 0, n, 0, d) for f, (n, d) in enumerate(zip(self.num_rows, self.dims))]
        )


def row_blocks(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous row ranges, the first ``num_rows % parts`` one row longer (as the planner)."""
    sizes = [num_rows // parts + (1 if r < num_rows % parts else 0) for r in range(parts)]
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def _check_placement(p: TablePlacement, dim: int, world: int) -> None:
    if p.kind not in KINDS:
        raise ValueError(f"table {p.table}: unknown sharding kind {p.kind!r}")
    if any(not 0 <= r < world for r in p.ranks) or not p.ranks:
        raise ValueError(f"table {p.table}: ranks {p.ranks} outside world size {world}")
    if p.kind == "table_wise" and len(p.ranks) != 1:
        raise ValueError(f"table {p.table}: table_wise needs exactly one rank")
    if p.kind == "data_parallel" and sorted(p.ranks) != list(range(world)):
        raise ValueError(f"table {p.table}: data_parallel is on every rank, not {p.ranks}")
    if p.kind == "column_wise":
        if len(p.dims) != len(p.ranks) or sum(p.dims) != dim or min(p.dims) < 1:
            raise ValueError(
                f"table {p.table}: column_wise dims {p.dims} must have one width per rank "
                f"({p.ranks}) adding up to the table dim {dim}"
            )


def build_layout(
    names: list[str], num_rows: list[int], dims: list[int], plan: ShardingPlan
) -> ShardLayout:
    by_name = {p.table: p for p in plan.placements}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"the sharding plan has no placement for tables {missing}")
    world = plan.world_size
    shards: list[Shard] = []
    dp: list[int] = []
    for f, name in enumerate(names):
        p = by_name[name]
        _check_placement(p, dims[f], world)
        n, d = num_rows[f], dims[f]
        if p.kind == "data_parallel":
            dp.append(f)
        elif p.kind == "table_wise":
            shards.append(Shard(len(shards), f, p.kind, p.ranks[0], 0, n, 0, d))
        elif p.kind == "row_wise":
            for r, (lo, hi) in zip(p.ranks, row_blocks(n, len(p.ranks))):
                shards.append(Shard(len(shards), f, p.kind, r, lo, hi, 0, d))
        else:
            c = 0
            for r, w in zip(p.ranks, p.dims):
                shards.append(Shard(len(shards), f, p.kind, r, 0, n, c, c + w))
                c += w
    per_rank = [RankShards([s for s in shards if s.owner == r]) for r in range(world)]
    return ShardLayout(list(num_rows), list(dims), shards, dp, per_rank)


def table_bytes_per_rank(
    layout: ShardLayout,
    row_bytes_of: Callable[[int], int],
    keep: Callable[[int], bool] = lambda _f: True,
) -> list[int]:
    """Bytes of table rows on each rank: its shards plus every replicated table, a row
    of width w costing ``row_bytes_of(w)``; ``keep(feature)`` selects the tables."""
    dp = sum(
        layout.num_rows[f] * row_bytes_of(layout.dims[f]) for f in layout.dp_features if keep(f)
    )
    return [
        dp + sum(s.num_rows * row_bytes_of(s.width) for s in rs.shards if keep(s.feature))
        for rs in layout.per_rank
    ]
