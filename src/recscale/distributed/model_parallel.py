"""``shard(model, plan, ctx)``: the single-device DLRM made hybrid-parallel from outside.

* ``model.embeddings`` (an :class:`EmbeddingBagCollection`, possibly still on the meta
  device) is replaced by its sharded twin holding only this rank's shards (at world
  size 1 with a one-rank plan: the whole tables, both distribution stages idle);
* each table's tier is the plan's (``TablePlacement.placement``: host/ssd with its cache),
  else the table's own (``embedding.placement``);
* the rest (bottom/top MLPs, interaction) is wrapped in DistributedDataParallel on
  the ``dense`` group, with every ``embeddings.*`` parameter and buffer excluded
  (they are not replicas: each rank holds different shards).

The model code never imports this package.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recscale.distributed.context import DistContext
from recscale.distributed.sharded_embedding import (
    ShardedEmbeddingBagCollection,
    StorageFactory,
)
from recscale.embedding.storage import DevicePlacementError
from recscale.models.dlrm import DLRM
from recscale.planner import ShardingPlan, TablePlacement
from recscale.planner.layout import build_layout


def one_rank_plan(names: list[str]) -> ShardingPlan:
    """World size 1: every table whole on rank 0 (the identity layout)."""
    return ShardingPlan(
        1, [TablePlacement(n, "table_wise", [0], {}, {}) for n in names], [0], [0.0]
    )


def shard(
    model: DLRM,
    plan: ShardingPlan,
    ctx: DistContext,
    make_storage: StorageFactory | None = None,
    row_precision: str = "fp32",
) -> nn.Module:
    """Returns the module to train (DDP-wrapped when ``ctx`` is distributed); ``model``
    itself is changed in place, so ``model.embeddings`` is the sharded collection. The
    shards take the collection's optimizer, init seed and kernel choice; ``make_storage``
    builds their storages (``embedding/placement.py``; needed for the host/ssd tiers and
    row precisions), ``row_precision`` is that of the replicated tables' rows."""
    if plan.world_size != ctx.world_size:
        raise ValueError(f"plan for {plan.world_size} ranks, job has {ctx.world_size}")
    ebc = model.embeddings
    by_name = {p.table: p for p in plan.placements}
    tables = []
    for t in ebc.tables:
        p = by_name.get(t.name)
        if p is not None and p.placement != "device":
            t = replace(t, placement=p.placement, cache_bytes=p.cache_bytes)
        if p is not None and p.kernel:
            t = replace(t, kernel=p.kernel)
        tables.append(t)
    if make_storage is None and any(
        t.placement != "device" or t.compression != "none" for t in tables
    ):
        raise ValueError(
            "host/ssd and compressed tables need make_storage (embedding.placement.storage_factory)"
        )
    layout = build_layout(
        [t.name for t in tables], [t.num_rows for t in tables], [t.dim for t in tables], plan
    )
    model.embeddings = ShardedEmbeddingBagCollection(
        tables,
        ebc.pooling,
        ebc.make_optimizer,
        layout,
        ctx,
        seed=ebc.seed,
        validate_ids=ebc.validate_ids,
        kernel=ebc.kernel,
        make_storage=make_storage,
        row_precision=row_precision,
        init_rows=ebc.init_rows,
    )
    model.to(ctx.device)
    wrong = model.embeddings.misplaced(ctx.device)
    if wrong:  # e.g. a tier's cache made on the CPU under a CUDA run
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise DevicePlacementError(f"training on {ctx.device}: {wrong[0]}{more}")
    if not ctx.distributed:
        return model
    ignore = [n for n, _ in model.named_parameters() if n.startswith("embeddings.")]
    ignore += [n for n, _ in model.named_buffers() if n.startswith("embeddings.")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # No replicated buffers to keep in sync: skip the per-forward broadcast (the newer
    # ``forward_sync_buffers`` would still sync them at init; ours are rank-local).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(
            model, device_ids=device_ids, process_group=ctx.dense, broadcast_buffers=False
        )
