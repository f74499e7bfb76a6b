"""A config -> the planner's plain-data inputs, and the plan a training job uses."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.config.small_files import loads_json, read_small_text
from recscale.data.columns import DatasetError, read_metadata
from recscale.data.synthetic import zipf_share
from recscale.embedding import kernels
from recscale.embedding.cached_storage import ROW_INDEX_BYTES, SLOT_OVERHEAD_BYTES
from recscale.embedding.compressed import table_compressions
from recscale.embedding.low_precision import bytes_per_value, row_overhead
from recscale.embedding.row_file import mem_available
from recscale.embedding.sizing import (
    INIT_DRAW_MAX_VALUES,
    compressed_table_bytes,
    row_bytes,
    state_bytes,
)
from recscale.planner.costs import CostLaws
from recscale.planner.layout import build_layout
from recscale.planner.plan import (
    Constraints,
    PlanError,
    ShardingPlan,
    TableInfo,
    TablePlacement,
    Topology,
    plan_sharding,
)
from recscale.planner.types import KINDS

# Where the hit curve is read: the share of rows a cache may hold.
_CURVE_FRACTIONS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)


def hit_curves(cfg: Config) -> list[tuple[tuple[float, float], ...]]:
    """Each table's hit curve ((fraction of rows, share of lookups), ...): synthetic
    data's exact Zipf law; a dataset's id-frequency summary (``metadata.json``: the top
    1% and 10% of its distinct ids, and all of them); () where neither says."""
    m = cfg.model
    if not cfg.data.uses_dataset():
        a = cfg.data.zipf_alpha
        return [
            tuple((f, zipf_share(f * n, n, a)) for f in _CURVE_FRACTIONS) for n in m.table_sizes
        ]
    try:
        freq = read_metadata(cfg.data.path).get("id_frequency_train") or {}
    except DatasetError:
        freq = {}
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
        ok = all(0 < x <= 1 and 0 <= y <= 1 for x, y in points)
        curves.append(tuple(sorted(points)) if ok else ())
    return curves


def table_infos(cfg: Config) -> list[TableInfo]:
    m = cfg.model
    mean = (cfg.data.min_ids_per_feature + cfg.data.max_ids_per_feature) / 2
    pooling = [float(k) for k in cfg.data.bag_sizes] or [mean] * len(m.table_sizes)
    e = cfg.embedding
    comp = table_compressions(m.table_sizes, m.dims(), e)
    curves = hit_curves(cfg)
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


def available_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` (free GPU memory; the host's
    MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return mem_available()


# The ssd tier's default cache: this share of the memory available at start, its
# bookkeeping and the tables' row indices included; the rest is left to the model, the
# data and the page cache (which keeps the file's next-warmest pages, rows ordered by
# popularity). A slot of the cache holds one row the batches want; a page of the page
# cache holds ~60 rows of which a few are. On benchmarks/beyond_ram.toml (23 GiB host,
# docs/performance.md) a 5.3 GB cache (share 0.5) trained at 30.1k samples/s, 7.0 GB
# (~0.64) at 36.8k, 8.3-8.5 GB (0.65-0.72) at 35.4-36.1k with the process at 21.3-21.7
# of 23 GiB: past ~0.6 the page cache is gone and the gain with it.
SSD_CACHE_SHARE = 0.6


def _cache_bytes_in(room: float, row: float) -> float:
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
    budget = int(min(table_bytes, max(_cache_bytes_in(room, row), table_bytes / 100)))
    echo(
        f"recscale: ssd tier: cache {budget / 1e9:.2f} GB ({budget / max(table_bytes, 1):.0%} "
        f"of the tables' {table_bytes / 1e9:.2f} GB) from {SSD_CACHE_SHARE:.0%} of the "
        f"{free / 1e9:.1f} GB of memory available"
        + (" to each rank" if ranks > 1 else "")
        + " with the cache's bookkeeping; the rest is left to the page cache "
        "(embedding.cache_bytes sets it)"
    )
    return budget


# Above this share of the memory available, an explicit ssd cache is warned about: the
# rest is the page cache's, the data's and the initialization's (a table's initial rows
# are drawn whole to be written in file order - 1.4 GB for a 22M-row table of dim 16).
SSD_CACHE_WARN_SHARE = 0.8


def check_ssd_cache_fits(
    cfg: Config, sizes: list[int], world_size: int, echo: Callable[[str], None]
) -> None:
    """An explicit ``embedding.cache_bytes`` for the ssd tier on the CPU, against the
    memory available to each rank: the cache with its per-slot bookkeeping, the per-row
    indices and the largest table's initial draw (fp32 rows, at most 4 GB: larger tables
    are drawn a chunk at a time). More than the memory: a ConfigError naming the key,
    before anything is allocated (not a kernel OOM kill minutes into initialization);
    more than ``SSD_CACHE_WARN_SHARE`` of it: a warning."""
    e, m = cfg.embedding, cfg.model
    w = max(world_size, 1)
    free = available_memory(torch.device("cpu")) // w
    total = max(sum(sizes), 1)
    rows = sum(m.table_sizes) // w
    row = total / max(sum(m.table_sizes), 1)
    cache = min(e.cache_bytes, total) // w  # a cache holds at most the tables
    slots = cache / row
    draw = max(
        (min(n * d, INIT_DRAW_MAX_VALUES) * 4 for n, d in zip(m.table_sizes, m.dims())), default=0
    )
    need = cache + SLOT_OVERHEAD_BYTES * slots + ROW_INDEX_BYTES * rows + draw
    what = (
        f"a cache of {cache / 1e9:.2f} GB{' a rank' if w > 1 else ''} needs {need / 1e9:.2f} "
        f"GB of memory with its bookkeeping ({SLOT_OVERHEAD_BYTES} bytes a slot), the tables' "
        f"row indices ({ROW_INDEX_BYTES} bytes a row) and the largest table's initial draw "
        f"({draw / 1e9:.2f} GB); {free / 1e9:.2f} GB of memory is available"
        + (" to each rank" if w > 1 else "")
    )
    if need > free:
        most = max(0.0, _cache_bytes_in(free - ROW_INDEX_BYTES * rows - draw, row))
        raise ConfigError(
            "embedding.cache_bytes",
            f"{what}: at most {int(most * w):,} fits, or leave it 0 for the default "
            f"({SSD_CACHE_SHARE:.0%} of the memory available)",
        )
    if need > SSD_CACHE_WARN_SHARE * free:
        echo(
            f"recscale: warning: embedding.cache_bytes: {what} - "
            f"{need / max(free, 1):.0%} of it, little left for the page cache and the run "
            "(the kernel may kill the process for memory)"
        )


def default_memory_per_rank(device: torch.device, local_world: int) -> int:
    """Half of the device's memory (CUDA) or of the host memory shared by the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // (2 * max(local_world, 1))


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
                f"{d.plan} is a plan for {plan.world_size} ranks but the job has {world_size}",
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


def placement_plan(cfg: Config, ssd_dir: str, device: torch.device | None = None) -> ShardingPlan:
    """``embedding.placement=auto`` for one process: the planner with the training
    device's memory budget (``embedding.memory_budget_gb``; default half of it) and, for
    the tables that do not fit, host memory behind an HBM cache (GPU runs) and then the
    free space under ``ssd_dir`` as the ssd tier."""
    e = cfg.embedding
    device = device or torch.device("cpu")
    memory = (
        int(e.memory_budget_gb * 1e9) if e.memory_budget_gb else default_memory_per_rank(device, 1)
    )
    host = 0
    if device.type == "cuda":  # the host tier: most of the host memory
        host = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)
    Path(ssd_dir).mkdir(parents=True, exist_ok=True)
    ssd = int(shutil.disk_usage(ssd_dir).free * 0.9)
    tables = table_infos(cfg)
    total = sum(t.bytes for t in tables)
    fraction = min(1.0, e.cache_bytes / total) if e.cache_bytes else 0.1
    topo = Topology(1, memory, ssd_per_rank=ssd, host_per_rank=host)
    cons = Constraints(batch_size=cfg.train.batch_size, ssd_cache_fraction=fraction)
    return plan_sharding(tables, topo, cons)


# A default cache holds at least this many batches' worth of each table's rows (or the
# whole table): the batch stepping, the one prefetched and room for warm rows kept for
# the run (``pin_limit`` leaves two batches unpinned). 10% of small tables (the debug
# preset's 7,700 rows) held fewer rows than one batch of 256 touches, and the run stopped.
IN_FLIGHT_BATCHES = 4


def batch_ids_per_table(cfg: Config) -> int:
    """At most how many ids of one table a (global) batch brings to the rank that holds
    it: its samples times the largest bag (synthetic bags, or a multi-hot dataset's
    ``bag_sizes``)."""
    bags = list(cfg.data.bag_sizes) or [cfg.data.max_ids_per_feature]
    if cfg.data.uses_dataset():
        try:
            bags = [int(b) for b in read_metadata(cfg.data.path).get("bag_sizes") or [1]]
        except (DatasetError, TypeError, ValueError):
            bags = [1]
    return cfg.train.batch_size * max(max(bags, default=1), 1)


def in_flight_cache_bytes(cfg: Config) -> int:
    """The cache bytes (rows and state) ``IN_FLIGHT_BATCHES`` batches of each table need
    at most, a table at most whole: the least a default cache holds."""
    e, m = cfg.embedding, cfg.model
    ids = IN_FLIGHT_BATCHES * batch_ids_per_table(cfg)
    return sum(min(n, ids) * row_bytes(e, d) for n, d in zip(m.table_sizes, m.dims()))


def configured_tiers(
    cfg: Config, echo: Callable[[str], None], device: torch.device | None, world_size: int
) -> list[tuple[str, int]] | None:
    """Each table's (tier, cache bytes) that ``embedding.placement`` asks for, or None
    for none beyond the plan's own: ``ssd`` / ``host`` put every plain table there, the
    cache (``cache_bytes``; default: ssd from free memory, :func:`default_ssd_cache`;
    host 10% of the tables; either at least :func:`in_flight_cache_bytes`) split by
    table bytes; ``auto`` at
    world size 1 asks the planner (at several ranks ``plan_for`` places tiers itself).
    A compressed table is small by construction: it stays in device memory."""
    e, m = cfg.embedding, cfg.model
    comp = table_compressions(m.table_sizes, m.dims(), e)
    if e.placement == "auto" and world_size == 1:
        tiers = auto_placements(cfg, echo, device)
    elif e.placement in ("ssd", "host"):
        sizes = [n * row_bytes(e, d) for n, d in zip(m.table_sizes, m.dims())]
        least = in_flight_cache_bytes(cfg)
        budget = e.cache_bytes or max(sum(sizes) // 10, least)
        if not e.cache_bytes and e.placement == "ssd":
            free = available_memory(torch.device("cpu")) // max(world_size, 1)
            rows = sum(m.table_sizes) // max(world_size, 1)
            budget = default_ssd_cache(
                sum(sizes) // max(world_size, 1), rows, free, echo, world_size
            )
            budget *= max(world_size, 1)  # split by table bytes below, then among the ranks
            budget = min(sum(sizes), max(budget, least))
        elif e.placement == "ssd" and (device is None or device.type == "cpu"):
            check_ssd_cache_fits(cfg, sizes, world_size, echo)
        tiers = [(e.placement, int(budget * b / max(sum(sizes), 1))) for b in sizes]
    else:
        return None
    return [("device", 0) if c != "none" else t for t, (c, _) in zip(tiers, comp)]


def with_tiers(plan: ShardingPlan, tiers: list[tuple[str, int]] | None) -> ShardingPlan:
    """``plan`` with each table's tier and cache set from ``tiers`` (in table order)."""
    if tiers is None:
        return plan
    placements = [
        replace(p, placement=t, cache_bytes=c) if t != "device" else p
        for p, (t, c) in zip(plan.placements, tiers)
    ]
    return replace(plan, placements=placements)


def with_kernels(plan: ShardingPlan, cfg: Config, device: torch.device) -> ShardingPlan:
    """``plan`` with the embedding kernel family each plain table's storage runs, decided
    here once (``embedding/kernels.py``'s order for ``model.kernels`` on a tensor like
    the table's rows: its dim, its row dtype, the device its rows or cache live on); a
    storage then asks its own kernel only what that family cannot take. Compressed
    tables (their own factor ops) keep the configured request."""
    m, e = cfg.model, cfg.embedding
    comp = table_compressions(m.table_sizes, m.dims(), e)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "split_bf16": torch.bfloat16}.get(
        e.row_precision, torch.float32
    )
    chosen = {}
    for p, d, (c, _) in zip(plan.placements, m.dims(), comp):
        if c != "none":
            continue
        probe = torch.empty(1, d, dtype=dtype, device=device)
        chosen[p.table] = kernels.choose(m.kernels, "backward", probe, d)
    placements = [replace(p, kernel=chosen.get(p.table, "")) for p in plan.placements]
    return replace(plan, placements=placements)


def auto_placements(
    cfg: Config, echo: Callable[[str], None], device: torch.device | None = None
) -> list[tuple[str, int]]:
    """``embedding.placement=auto``: ask the planner which tables leave device memory
    (the largest, until the rest fits the memory budget: to host memory on a GPU run,
    else ssd) and with how much cache."""
    try:
        plan = placement_plan(cfg, cfg.embedding.ssd_dir, device)
    except PlanError as e:
        raise ConfigError("embedding.memory_budget_gb", str(e)) from e
    moved = [p for p in plan.placements if p.placement != "device"]
    if moved:
        tiers = ", ".join(sorted({p.placement for p in moved}))
        gb = sum(p.ssd_bytes for p in moved) / 1e9
        cache = sum(p.cache_bytes for p in moved) / 1e9
        echo(
            f"recscale: placement auto: {len(moved)} tables on {tiers} "
            f"({gb:.2f} GB, cache {cache:.2f} GB), "
            f"{len(plan.placements) - len(moved)} in device memory"
        )
    else:
        echo("recscale: placement auto: every table fits in memory")
    return [(p.placement, p.cache_bytes) for p in plan.placements]
