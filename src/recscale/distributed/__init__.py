"""Hybrid-parallel training on torch.distributed: sharded embeddings, replicated MLPs.

Layered above ``modules/`` and ``models/``, which never import it.
"""

from recscale.distributed.context import (
    DistContext,
    init_distributed,
    launched_by_torchrun,
    shutdown,
)
from recscale.distributed.model_parallel import one_rank_plan, shard
from recscale.distributed.sharded_embedding import ShardedEmbeddingBagCollection
from recscale.planner.from_config import plan_for, table_infos, uniform_plan
from recscale.planner.layout import Shard, ShardLayout, build_layout

__all__ = [
    "DistContext",
    "Shard",
    "ShardLayout",
    "ShardedEmbeddingBagCollection",
    "build_layout",
    "init_distributed",
    "launched_by_torchrun",
    "one_rank_plan",
    "plan_for",
    "shard",
    "shutdown",
    "table_infos",
    "uniform_plan",
]
