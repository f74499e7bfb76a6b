"""Plain-data inputs and output of the planner (JSON-serialisable, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from recscale.config.schema import SHARDING_KINDS

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
        placements = [
            TablePlacement(
                p["table"],
                p["kind"],
                list(p["ranks"]),
                {int(k): int(v) for k, v in p["memory_per_rank"].items()},
                {int(k): float(v) for k, v in p["cost_per_rank"].items()},
                list(p.get("dims", [])),
                p.get("placement", "device"),
                int(p.get("cache_bytes", 0)),
                int(p.get("ssd_bytes", 0)),
                str(p.get("kernel", "")),
                float(p.get("hit_rate", 0.0)),
            )
            for p in d["placements"]
        ]
        return ShardingPlan(
            d["world_size"], placements, list(d["memory_per_rank"]), list(d["cost_per_rank"])
        )
