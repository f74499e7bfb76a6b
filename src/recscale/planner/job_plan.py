"""What a training job adds to the plan on its own device: the memory there (free GPU
memory, the host's MemAvailable), the tiers and caches ``embedding.placement`` asks for
(``configured_tiers``), each plain table's kernel family (``with_kernels``). This part
of the planner asks the device (torch); the plan itself is ``from_config.py``'s."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.embedding import kernels
from recscale.embedding.compression_shapes import table_compressions
from recscale.embedding.sizing import (
    INIT_DRAW_MAX_VALUES,
    ROW_INDEX_BYTES,
    SLOT_OVERHEAD_BYTES,
    row_bytes,
)
from recscale.planner.from_config import (
    SSD_CACHE_SHARE,
    cache_bytes_in,
    default_ssd_cache,
    in_flight_cache_bytes,
    table_infos,
)
from recscale.planner.plan import Constraints, PlanError, ShardingPlan, Topology, plan_sharding
from recscale.procfs import mem_available
from recscale.units import size_text


def available_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` (free GPU memory; the host's
    MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return mem_available()


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
        f"a cache of {size_text(cache)}{' a rank' if w > 1 else ''} needs {size_text(need)} "
        f"GB of memory with its bookkeeping ({SLOT_OVERHEAD_BYTES} bytes a slot), the tables' "
        f"row indices ({ROW_INDEX_BYTES} bytes a row) and the largest table's initial draw "
        f"({size_text(draw)}); {size_text(free)} of memory is available"
        + (" to each rank" if w > 1 else "")
    )
    if need > free:
        most = max(0.0, cache_bytes_in(free - ROW_INDEX_BYTES * rows - draw, row))
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


def ssd_free_bytes(ssd_dir: str) -> int:
    """Free bytes of the disk the ssd tier's files go to: ``ssd_dir`` (made if missing),
    or where an empty one puts them (a temp dir, ``embedding/placement.py``)."""
    where = Path(ssd_dir or tempfile.gettempdir())
    try:
        where.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(where).free
    except OSError as e:  # a file in the way, no permission: "No such file" named nothing
        raise ConfigError(
            "embedding.ssd_dir", f"cannot hold the ssd tier's files at {where}: {e.strerror or e}"
        ) from e


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
    ssd = int(ssd_free_bytes(ssd_dir) * 0.9)
    tables = table_infos(cfg)
    total = sum(t.bytes for t in tables)
    fraction = min(1.0, e.cache_bytes / total) if e.cache_bytes else 0.1
    topo = Topology(1, memory, ssd_per_rank=ssd, host_per_rank=host)
    cons = Constraints(batch_size=cfg.train.batch_size, ssd_cache_fraction=fraction)
    return plan_sharding(tables, topo, cons)


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
        # what a kernel asks of the rows is their device, dtype and layout; the width goes
        # as ``d`` (a [1, d] probe allocated d floats before the memory check saw them).
        # A tier's cache holds fp32 rows at any row precision it takes (split_bf16).
        rows_dtype = dtype if p.placement == "device" else torch.float32
        probe = torch.empty(1, 1, dtype=rows_dtype, device=device)
        chosen[p.table] = kernels.choose(m.kernels, "backward", probe, d)
    # a dot interaction's kernel asked for by name is checked now too: found at the first
    # step, its error left the run directory behind (config.toml), and no rerun could
    # use it. (Under bf16 on a GPU the interaction runs autocast's torch ops: no kernel.)
    if m.interaction == "dot" and not (device.type == "cuda" and cfg.train.precision == "bf16"):
        probe = torch.empty(1, 1, dtype=torch.float32, device=device)
        kernels.choose(m.kernels, "interaction", probe, m.embedding_dim)
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
