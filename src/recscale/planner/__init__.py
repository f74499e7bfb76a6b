"""The sharding planner: a pure function from tables + topology to a plan (plain data)."""

from recscale.planner.plan import PlanError, plan_sharding
from recscale.planner.types import (
    KINDS,
    Constraints,
    ShardingPlan,
    TableInfo,
    TablePlacement,
    Topology,
)

__all__ = [
    "KINDS",
    "Constraints",
    "PlanError",
    "ShardingPlan",
    "TableInfo",
    "TablePlacement",
    "Topology",
    "plan_sharding",
]
