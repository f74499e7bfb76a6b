"""What ``train()`` does differently on more than one rank (world size 1 skips all of it).

* build the model with its tables on the meta device, plan, and ``shard`` it;
* each rank takes its slice ``[r B/W, (r+1) B/W)`` of every global batch;
* one all-reduce per step of (loss, stop flag): the logged loss is the global mean,
  a NaN anywhere stops every rank before any update, and a time limit hit on one
  rank stops all at the same step (collectives must stay matched);
* evaluation: every global eval batch is split (and padded) across ranks, and the
  predictions are all-gathered so the metrics are exact over the whole set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.data.batch import Batch
from recscale.distributed import DistContext, plan_for, shard
from recscale.distributed.planning import default_memory_per_rank
from recscale.models.dlrm import DLRM, build_model
from recscale.planner import PlanError, ShardingPlan


def build_sharded(cfg: Config, ctx: DistContext, echo: Callable[[str], None]
                  ) -> tuple[DLRM, nn.Module, ShardingPlan]:  # fmt: skip
    w = ctx.world_size
    if cfg.train.batch_size % w:
        raise ConfigError(
            "train.batch_size", f"{cfg.train.batch_size} does not divide across {w} ranks"
        )
    gb = cfg.distributed.memory_per_rank_gb
    memory = int(gb * 1e9) if gb else default_memory_per_rank(ctx.device, w)
    try:
        plan = plan_for(cfg, w, memory)
    except PlanError as e:
        raise ConfigError("distributed.memory_per_rank_gb", str(e)) from e
    model = build_model(cfg.model, cfg.embedding, device=ctx.device, seed=cfg.train.seed,
                        materialize_embeddings=False)  # fmt: skip
    module = shard(model, plan, ctx)
    kinds: dict[str, int] = {}
    for p in plan.placements:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    mem = plan.memory_per_rank
    echo(f"recscale: {w} ranks; sharding " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
         + (f"; planned embedding memory per rank {min(mem) / 1e9:.3f}-{max(mem) / 1e9:.3f} GB"
            if any(mem) else ""))  # fmt: skip
    return model, module, plan


def reduce_step(loss_value: float, stop: bool, ctx: DistContext) -> tuple[float, bool]:
    """Global mean loss and whether any rank wants to stop."""
    if not ctx.distributed:
        return loss_value, stop
    t = torch.tensor(
        [loss_value, float(stop)], dtype=torch.float64, device=ctx.device
    )  # NCCL: on the GPU
    dist.all_reduce(t, group=ctx.dense)
    return float(t[0]) / ctx.world_size, bool(t[1] > 0)


@torch.no_grad()
def evaluate_distributed(module: nn.Module, batches: Iterable[Batch], ctx: DistContext
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """All predictions and labels of the eval set, on every rank."""
    w, r = ctx.world_size, ctx.rank
    logits, labels = [], []
    for b in batches:
        n = -(-b.batch_size // w)  # ceil: the last rank's slice is padded
        lo, hi = min(r * n, b.batch_size), min((r + 1) * n, b.batch_size)
        local = b.slice(lo, hi).pad(n).to(ctx.device)
        out = module(local).float()
        gathered = [torch.empty_like(out) for _ in range(w)]
        dist.all_gather(gathered, out, group=ctx.dense)
        logits.append(torch.cat(gathered).cpu()[: b.batch_size])
        labels.append(b.labels.cpu())
    return torch.cat(logits), torch.cat(labels)
