"""Plain-data inputs and output of the planner (JSON-serialisable, no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from recscale.config.errors import counted
from recscale.config.schema import KERNELS, PLACEMENTS, SHARDING_KINDS

KINDS = SHARDING_KINDS


@dataclass(frozen=True)
class TableInfo:
    name: str
    rows: int
    dim: int
    pooling: float = 1.0  # mean ids per sample (access statistics)
    state_bytes_per_row: int = 4  # optimizer state (row-wise Adagrad: 4; Adam: 8 * dim; SGD: 0)
    bytes_per_value: int = 4  # fp32
    # a compressed table (embedding/compressed.py): its factors' bytes with their state,
    # and it is placed whole (table_wise) - 0 for a plain table
    compressed_bytes: int = 0
    # what of the above are the weights themselves, without optimizer state: int8's
    # per-row scale and bias (counted in state_bytes_per_row too), a compressed table's
    # factors
    row_overhead_bytes: int = 0
    compressed_weight_bytes: int = 0
    # The share of lookups the hottest rows take: ((fraction of rows, share), ...),
    # ascending - the hit rate of a cache holding that fraction (warm, LFU at steady
    # state); () = unknown (the planner assumes ``Constraints.ssd_hit_rate``).
    hit_curve: tuple[tuple[float, float], ...] = ()
    # The least cache the table takes on a slower tier: the rows of the batches in
    # flight (planner.from_config.in_flight_cache_bytes), or the whole table. A smaller
    # cache stops the run at its first step.
    min_cache_bytes: int = 0

    def hit_rate(self, cache_fraction: float, default: float) -> float:
        """The expected hit rate of a cache of ``cache_fraction`` of the rows: the curve
        read linearly between its points (from (0, 0) to (1, 1)), else ``default``."""
        if not self.hit_curve:
            return default
        f = min(max(cache_fraction, 0.0), 1.0)
        lo = (0.0, 0.0)
        for x, y in (*self.hit_curve, (1.0, 1.0)):
            if f <= x:
                return lo[1] + (y - lo[1]) * (f - lo[0]) / (x - lo[0]) if x > lo[0] else y
            lo = (x, y)
        return 1.0

    @property
    def bytes(self) -> int:
        """Bytes in training: the weights and their optimizer state."""
        if self.compressed_bytes:
            return self.compressed_bytes
        return self.rows * (self.dim * self.bytes_per_value + self.state_bytes_per_row)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights alone (what a model is served from and "a table of N GB
        before optimizer state" means)."""
        if self.compressed_bytes:
            return self.compressed_weight_bytes
        return self.rows * (self.dim * self.bytes_per_value + self.row_overhead_bytes)


@dataclass(frozen=True)
class Topology:
    world_size: int
    memory_per_rank: int  # bytes available for embedding tables on each rank
    all_to_all_bandwidth: float = 12.5e9  # bytes/s per rank (100 Gb/s)
    all_reduce_bandwidth: float = 12.5e9  # bytes/s per rank
    gather_bandwidth: float = 10e9  # bytes/s of random row reads on a rank
    latency: float = 20e-6  # seconds per collective
    ssd_per_rank: int = 0  # bytes of SSD for tables on each rank (0 = no ssd tier)
    ssd_bandwidth: float = 2e9  # bytes/s of row reads + write-backs on a rank's SSD
    host_per_rank: int = 0  # GPU runs: bytes of host memory for tables (0 = no host tier)
    host_bandwidth: float = 25e9  # bytes/s host <-> device (PCIe)


@dataclass(frozen=True)
class Constraints:
    batch_size: int  # global batch
    # Tables at most this big may be replicated (data_parallel).
    data_parallel_max_bytes: int = 64 << 20
    column_wise_min_dim: int = 16  # a column shard is at least this wide
    # ssd tier: the hot-row cache of a table on ssd, as a share of its bytes, and the
    # hit rate expected of it where the table has no hit curve of its own
    # (benchmarks/cache_hit_curve.py measures it per workload).
    ssd_cache_fraction: float = 0.1
    ssd_hit_rate: float = 0.9


@dataclass
class TablePlacement:
    table: str
    kind: str
    ranks: list[int]
    memory_per_rank: dict[int, int]  # bytes on each rank holding a part
    cost_per_rank: dict[int, float]  # seconds per step on each rank
    dims: list[int] = field(default_factory=list)  # column_wise: width of each shard
    placement: str = "device"  # where the rows live: device memory, or host/ssd behind a cache
    cache_bytes: int = 0  # host/ssd: the hot-row cache (counted in memory_per_rank)
    ssd_bytes: int = 0  # host/ssd: the table's bytes on that slower tier
    kernel: str = ""  # the embedding kernel family its storage runs ("": model.kernels)
    hit_rate: float = 0.0  # host/ssd: the cache's expected hit rate (the table's curve)


@dataclass
class ShardingPlan:
    world_size: int
    placements: list[TablePlacement]
    memory_per_rank: list[int]
    cost_per_rank: list[float]

    @property
    def max_cost(self) -> float:
        return max(self.cost_per_rank)

    def kind_counts(self) -> dict[str, int]:
        """How many tables each sharding kind places (in first-seen order)."""
        kinds: dict[str, int] = {}
        for p in self.placements:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        return kinds

    @property
    def imbalance(self) -> float:
        """Slowest rank / mean rank (1.0 = perfectly balanced)."""
        mean = sum(self.cost_per_rank) / len(self.cost_per_rank)
        return self.max_cost / mean if mean > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["max_cost"], d["imbalance"] = self.max_cost, self.imbalance
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ShardingPlan:
        """A plan from its JSON form (``to_dict``, ``recscale plan --json``). Raises
        ValueError naming the field that no plan holds: a world size or rank that is not
        a whole number, a kind, tier or kernel not among the choices, a negative cache, a
        table placed twice, repeated ranks, a placement key no placement has. The
        per-rank memory and cost figures are what the planner predicted: optional (a
        hand-written plan leaves them out), else one figure >= 0 a rank. Other top-level
        keys (``recscale plan --json``'s forecast) are read by no one."""
        if not isinstance(d, dict):
            raise ValueError("not a plan (a JSON object with world_size and placements)")
        ws = d.get("world_size")
        if not _whole(ws) or ws < 1:
            raise ValueError(f"world_size is {ws!r}, not a whole number >= 1")
        raw = d.get("placements")
        if not isinstance(raw, list):
            raise ValueError("placements is not a list (one object a table)")
        placements: list[TablePlacement] = []
        for i, p in enumerate(raw):
            placements.append(_placement_from_dict(f"placements[{i}]", p))
        seen: set[str] = set()
        for p in placements:
            if p.table in seen:
                raise ValueError(f"table {p.table} is placed twice")
            seen.add(p.table)
        memory = _numbers("memory_per_rank", d.get("memory_per_rank", [0] * ws), int, ws)
        cost = _numbers("cost_per_rank", d.get("cost_per_rank", [0.0] * ws), float, ws)
        return ShardingPlan(ws, placements, memory, cost)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(name: str, values: Any, kind: type, world_size: int) -> list:
    """One figure >= 0 a rank (what ``imbalance`` and ``recscale plan`` read)."""
    if not isinstance(values, list) or not all(_number(v) and v >= 0 for v in values):
        raise ValueError(f"{name} is not a list of numbers >= 0")
    if len(values) != world_size:
        raise ValueError(
            f"{name} has {counted(len(values), 'entry', 'entries')} for "
            f"{counted(world_size, 'rank')}"
        )
    return [kind(v) for v in values]


def _per_rank(where: str, values: Any, kind: type) -> dict:
    """``{"0": 123, ...}`` (JSON keys are strings) -> ``{0: 123, ...}``."""
    if not isinstance(values, dict) or not all(
        isinstance(k, str) and k.isdigit() and _number(v) and v >= 0 for k, v in values.items()
    ):
        raise ValueError(f"{where} is not an object of rank -> number >= 0")
    return {int(k): kind(v) for k, v in values.items()}


PLACEMENT_KEYS = frozenset(f.name for f in fields(TablePlacement))


def _placement_from_dict(where: str, p: Any) -> TablePlacement:
    if not isinstance(p, dict):
        raise ValueError(f"{where} is not an object")
    table = p.get("table")
    if not isinstance(table, str) or not table:
        raise ValueError(f"{where}.table is {table!r}, not a table name")
    where = f"{where} (table {table})"
    unknown = sorted(set(p) - PLACEMENT_KEYS)
    if unknown:  # a misspelt key ("placment") would leave its default in force unseen
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} (a placement's keys: "
            + ", ".join(sorted(PLACEMENT_KEYS))
            + ")"
        )

    def field_of(name: str, default: Any, ok, what: str) -> Any:
        v = p.get(name, default)
        if not ok(v):
            raise ValueError(f"{where}: {name} is {v!r}, not {what}")
        return v

    kind = field_of("kind", None, lambda v: v in KINDS, f"a kind ({', '.join(KINDS)})")
    ranks = field_of(
        "ranks",
        None,
        lambda v: isinstance(v, list) and all(_whole(r) for r in v) and len(set(v)) == len(v),
        "a list of distinct whole rank numbers",
    )
    dims = field_of(
        "dims", [], lambda v: isinstance(v, list) and all(_whole(x) for x in v), "a list of widths"
    )
    tier = field_of("placement", "device", lambda v: v in PLACEMENTS, f"one of {PLACEMENTS}")
    cache, ssd = (
        field_of(n, 0, lambda v: _whole(v) and v >= 0, "a whole number of bytes >= 0")
        for n in ("cache_bytes", "ssd_bytes")
    )
    kernel = field_of("kernel", "", lambda v: v == "" or v in KERNELS, f"'' or one of {KERNELS}")
    hit = field_of("hit_rate", 0.0, lambda v: _number(v) and 0 <= v <= 1, "a share in [0, 1]")
    return TablePlacement(
        table,
        kind,
        list(ranks),
        _per_rank(f"{where}: memory_per_rank", p.get("memory_per_rank", {}), int),
        _per_rank(f"{where}: cost_per_rank", p.get("cost_per_rank", {}), float),
        list(dims),
        tier,
        cache,
        ssd,
        kernel,
        float(hit),
    )
