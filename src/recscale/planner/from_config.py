"""A config -> the planner's plain-data inputs, and the plan a training job uses: plain
arithmetic on the config (and a dataset's metadata), no torch - ``recscale plan`` runs
on it alone. What a job adds on its own device (its memory, tiers, kernels) is
``job_plan.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from recscale.config.errors import ConfigError, counted
from recscale.config.schema import Config
from recscale.config.small_files import loads_json, read_small_text
from recscale.data.columns import DatasetError, read_metadata
from recscale.data.id_profile import CURVE_FRACTIONS
from recscale.data.zipf_law import zipf_share
from recscale.embedding.compression_shapes import table_compressions
from recscale.embedding.sizing import (
    ROW_INDEX_BYTES,
    SLOT_OVERHEAD_BYTES,
    bytes_per_value,
    compressed_table_bytes,
    row_bytes,
    row_overhead,
    state_bytes,
)
from recscale.planner.costs import CostLaws
from recscale.planner.layout import build_layout
from recscale.planner.plan import (
    Constraints,
    ShardingPlan,
    TableInfo,
    TablePlacement,
    Topology,
    plan_sharding,
)
from recscale.planner.types import KINDS
from recscale.units import size_text


def hit_curves(cfg: Config) -> list[tuple[tuple[float, float], ...]]:
    """Each table's hit curve ((fraction of rows, share of lookups), ...): synthetic
    data's exact Zipf law; a dataset's id profile's (each id's count over the train
    split, read at ``CURVE_FRACTIONS`` by preprocessing: data/id_profile.py), or where
    it has none its id-frequency summary (``metadata.json``: the top 1% and 10% of its
    distinct ids, and all of them); () where none says."""
    m = cfg.model
    if not cfg.data.uses_dataset():
        a = cfg.data.zipf_alpha
        return [tuple((f, zipf_share(f * n, n, a)) for f in CURVE_FRACTIONS) for n in m.table_sizes]
    try:
        meta = read_metadata(cfg.data.path)
    except DatasetError:
        meta = {}
    profiled = _profile_curves(meta, len(m.table_sizes))
    if profiled is not None:
        return profiled
    freq = meta.get("id_frequency_train") or {}
    curves = []
    for i, n in enumerate(m.table_sizes):
        s = freq.get(f"C{i + 1}") if isinstance(freq, dict) else None
        try:
            d = int(s["distinct"]) / max(n, 1)
            points = [
                (0.01 * d, float(s["top_1pct_share"])),
                (0.1 * d, float(s["top_10pct_share"])),
            ]
        except (TypeError, KeyError, ValueError):
            curves.append(())  # no summary, or a foreign one: the planner's default
            continue
        points.append((min(d, 1.0), 1.0))
        curves.append(tuple(sorted(points)) if _in_unit_square(points) else ())
    return curves


def _in_unit_square(points) -> bool:
    """Every (fraction of rows, share of lookups) of a curve in (0, 1] x [0, 1]."""
    return all(0 < x <= 1 and 0 <= y <= 1 for x, y in points)


def _profile_curves(meta: dict, tables: int) -> list[tuple[tuple[float, float], ...]] | None:
    """The id profile's hit curves from ``metadata.json``, or None where it has none
    that reads as one curve a table of points in [0, 1], rising."""
    try:
        raw = meta["id_profile"]["hit_curves"]
        curves = [tuple((float(x), float(y)) for x, y in c) for c in raw]
    except (KeyError, TypeError, ValueError):
        return None
    ok = len(curves) == tables and all(
        _in_unit_square(c) and all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(c, c[1:]))
        for c in curves
    )
    return curves if ok else None


def ids_per_sample(cfg: Config) -> list[float]:
    """Each table's ids a sample: a dataset's own - a multi-hot dataset's ``bag_sizes``,
    or its train split's ids a row spread over the tables (multi-hot Parquet records no
    sizes), one for a one-hot dataset - else the synthetic data's ``data.bag_sizes``, or
    the mean of ``min/max_ids_per_feature``."""
    f = len(cfg.model.table_sizes)
    if cfg.data.uses_dataset():
        try:
            meta = read_metadata(cfg.data.path)
            if not meta.get("multi_hot"):
                return [1.0] * f
            bags = [float(b) for b in meta.get("bag_sizes") or []]
            if len(bags) == f and all(b >= 0 for b in bags):
                return bags
            train = meta["splits"][cfg.data.train_split]
            mean = float(train["ids"]) / max(float(train["rows"]), 1.0) / f
            if math.isfinite(mean) and mean >= 0:
                return [mean] * f
        except (DatasetError, KeyError, TypeError, ValueError, AttributeError):
            pass  # an unreadable dataset is named where it is opened
    mean = (cfg.data.min_ids_per_feature + cfg.data.max_ids_per_feature) / 2
    return [float(k) for k in cfg.data.bag_sizes] or [mean] * f


def table_infos(cfg: Config) -> list[TableInfo]:
    m = cfg.model
    pooling = ids_per_sample(cfg)
    e = cfg.embedding
    comp = table_compressions(m.table_sizes, m.dims(), e)
    curves = hit_curves(cfg)
    least = in_flight_bytes_per_table(cfg)
    infos = []
    for i, ((n, d), (c, sd)) in enumerate(zip(zip(m.table_sizes, m.dims()), comp)):
        total, weights = compressed_table_bytes(c, n, d, sd, e)
        infos.append(
            TableInfo(
                f"C{i + 1}",
                n,
                d,
                pooling[i],
                state_bytes(e, d) + row_overhead(e.row_precision),
                bytes_per_value(e.row_precision),
                total,
                row_overhead(e.row_precision),
                weights,
                curves[i],
                least[i],
            )
        )
    return infos


def uniform_plan(tables: list[TableInfo], world_size: int, kind: str) -> ShardingPlan:
    """Every table sharded the same way (``column_wise``: split in ``world_size`` equal
    column blocks when the dim allows, else the largest divisor of the dim)."""
    if kind not in KINDS:
        raise ValueError(f"unknown sharding kind {kind!r}")
    w = world_size
    placements = []
    for i, t in enumerate(tables):
        if kind == "data_parallel":
            p = TablePlacement(t.name, kind, list(range(w)), {}, {})
        elif kind == "table_wise":
            p = TablePlacement(t.name, kind, [i % w], {}, {})
        elif kind == "row_wise":
            p = TablePlacement(t.name, kind, list(range(w)), {}, {})
        else:
            k = max(d for d in range(1, w + 1) if t.dim % d == 0)
            ranks = [(i + j) % w for j in range(k)]
            p = TablePlacement(t.name, kind, ranks, {}, {}, [t.dim // k] * k)
        placements.append(p)
    return ShardingPlan(w, placements, [0] * w, [0.0] * w)


# The ssd tier's default cache: this share of the memory available at start, its
# bookkeeping and the tables' row indices included; the rest is left to the model, the
# data and the page cache (which keeps the file's next-warmest pages, rows ordered by
# popularity). A slot of the cache holds one row the batches want; a page of the page
# cache holds ~60 rows of which a few are. On benchmarks/beyond_ram.toml (23 GiB host,
# docs/performance.md) a 5.3 GB cache (share 0.5) trained at 30.1k samples/s, 7.0 GB
# (~0.64) at 36.8k, 8.3-8.5 GB (0.65-0.72) at 35.4-36.1k with the process at 21.3-21.7
# of 23 GiB: past ~0.6 the page cache is gone and the gain with it.
SSD_CACHE_SHARE = 0.6


def cache_bytes_in(room: float, row: float) -> float:
    """The cache bytes (rows of ``row`` bytes) that ``room`` bytes of memory hold with
    each slot's bookkeeping beside its row."""
    return room * row / (row + SLOT_OVERHEAD_BYTES)


def default_ssd_cache(
    table_bytes: int, table_rows: int, free: int, echo: Callable[[str], None], ranks: int = 1
) -> int:
    """Cache bytes (rows + optimizer state) for ssd tables of ``table_bytes`` in
    ``table_rows`` rows, from ``free`` bytes of memory per rank: ``SSD_CACHE_SHARE`` of
    it, less the per-row indices, shared between the rows and their per-slot
    bookkeeping; at least 1% of the tables. Says what it chose."""
    row = table_bytes / max(table_rows, 1)
    room = SSD_CACHE_SHARE * free - ROW_INDEX_BYTES * table_rows
    budget = int(min(table_bytes, max(cache_bytes_in(room, row), table_bytes / 100)))
    echo(
        f"recscale: ssd tier: cache {size_text(budget)} ({budget / max(table_bytes, 1):.0%} "
        f"of the tables' {size_text(table_bytes)}) from {SSD_CACHE_SHARE:.0%} of the "
        f"{size_text(free)} of memory available"
        + (" to each rank" if ranks > 1 else "")
        + " with the cache's bookkeeping; the rest is left to the page cache "
        "(embedding.cache_bytes sets it)"
    )
    return budget


def plan_for(
    cfg: Config,
    world_size: int,
    memory_per_rank: int,
    ssd_per_rank: int = 0,
    laws: CostLaws | None = None,
) -> ShardingPlan:
    """The plan a job runs: a plan file, one kind for all tables, or the planner's
    (``ssd_per_rank`` > 0: with an ssd tier for the tables that do not fit; ``laws``:
    its costs, e.g. ``calibrated_laws(cfg)``, so it picks what the performance model
    predicts fastest)."""
    d = cfg.distributed
    tables = table_infos(cfg)
    if d.plan:
        text = read_small_text(d.plan, "distributed.plan")
        try:
            plan = ShardingPlan.from_dict(loads_json(text))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not a plan's shape
            raise ConfigError("distributed.plan", f"cannot read a plan from {d.plan}: {e}") from e
        if plan.world_size != world_size:
            raise ConfigError(
                "distributed.plan",
                f"{d.plan} is a plan for {counted(plan.world_size, 'rank')} but the job has "
                f"{world_size}",
            )
        names = {t.name for t in tables}
        strangers = [p.table for p in plan.placements if p.table not in names]
        if strangers:  # a plan made for another model
            raise ConfigError(
                "distributed.plan",
                f"{d.plan} places tables the model does not have: {', '.join(strangers[:5])}"
                + (f" (and {len(strangers) - 5} more)" if len(strangers) > 5 else "")
                + f"; the model's tables are C1..C{len(tables)}",
            )
        tiered = sorted({p.placement for p in plan.placements} - {"device"})
        if tiered and cfg.embedding.placement != "device":  # which of the two would win?
            raise ConfigError(
                "embedding.placement",
                f"{cfg.embedding.placement} asks for every table's tier, and {d.plan} places "
                f"tables on {', '.join(tiered)} itself: keep one (embedding.placement=device "
                "follows the plan's tiers)",
            )
        try:  # every table placed, on ranks of the job, column splits that add up
            build_layout(
                [t.name for t in tables], [t.rows for t in tables], [t.dim for t in tables], plan
            )
        except ValueError as e:
            raise ConfigError("distributed.plan", f"{d.plan} does not fit the model: {e}") from e
        return plan
    if d.sharding != "auto":
        return uniform_plan(tables, world_size, d.sharding)
    topo = Topology(world_size, memory_per_rank, ssd_per_rank=ssd_per_rank)
    return plan_sharding(tables, topo, Constraints(batch_size=cfg.train.batch_size), laws)


# A default cache holds at least this many batches' worth of each table's rows (or the
# whole table): the batch stepping, the one prefetched and room for warm rows kept for
# the run (``pin_limit`` leaves two batches unpinned). 10% of small tables (the debug
# preset's 7,700 rows) held fewer rows than one batch of 256 touches, and the run stopped.
IN_FLIGHT_BATCHES = 4


def batch_ids_per_table(cfg: Config) -> int:
    """At most how many ids of one table a (global) batch brings to the rank that holds
    it: its samples times the largest bag (a dataset's, as ``ids_per_sample`` reads them;
    synthetic bags, or ``max_ids_per_feature``)."""
    if cfg.data.uses_dataset():
        bags = ids_per_sample(cfg)
    else:
        bags = [float(b) for b in cfg.data.bag_sizes] or [float(cfg.data.max_ids_per_feature)]
    return cfg.train.batch_size * max(math.ceil(max(bags, default=1.0)), 1)


def in_flight_bytes_per_table(cfg: Config) -> list[int]:
    """The cache bytes (rows and state) ``IN_FLIGHT_BATCHES`` batches of each table need
    at most, a table at most whole: the least a cache of it holds."""
    e, m = cfg.embedding, cfg.model
    ids = IN_FLIGHT_BATCHES * batch_ids_per_table(cfg)
    return [min(n, ids) * row_bytes(e, d) for n, d in zip(m.table_sizes, m.dims())]


def in_flight_cache_bytes(cfg: Config) -> int:
    """:func:`in_flight_bytes_per_table` over all tables: the least a default cache holds."""
    return sum(in_flight_bytes_per_table(cfg))


def with_tiers(plan: ShardingPlan, tiers: list[tuple[str, int]] | None) -> ShardingPlan:
    """``plan`` with each table's tier and cache set from ``tiers`` (in table order)."""
    if tiers is None:
        return plan
    placements = [
        replace(p, placement=t, cache_bytes=c) if t != "device" else p
        for p, (t, c) in zip(plan.placements, tiers)
    ]
    return replace(plan, placements=placements)
