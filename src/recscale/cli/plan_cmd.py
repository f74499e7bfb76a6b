"""``recscale plan --config NAME --world-size N [--memory-per-rank GB] [--json]``: a dry run of
the sharding planner (no process group): placement, memory and cost per rank, imbalance."""

from __future__ import annotations

import argparse
import json
import sys

from recscale.config.loader import load_config, preset_names
from recscale.planner import Constraints, PlanError, Topology, plan_sharding
from recscale.planner.from_config import table_infos


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan table sharding for N ranks (dry run, no processes)")
    p.add_argument(
        "--config", default="default", help=f"preset ({', '.join(preset_names())}) or TOML path"
    )
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--memory-per-rank", type=float, default=64.0, help="GB for embedding tables per rank"
    )
    p.add_argument(
        "--all-to-all-gbps", type=float, default=12.5, help="GB/s per rank (default 100 Gb/s)"
    )
    p.add_argument(
        "--gather-gbps", type=float, default=10.0, help="random row-gather GB/s per rank"
    )
    p.add_argument(
        "--ssd-per-rank", type=float, default=0.0, help="GB of SSD per rank for tables (0 = none)"
    )
    p.add_argument("--ssd-gbps", type=float, default=2.0, help="SSD GB/s per rank")
    p.add_argument(
        "--host-per-rank", type=float, default=0.0,
        help="GPU runs: GB of host memory per rank for tables under a GPU cache (0 = none)",
    )  # fmt: skip
    p.add_argument(
        "--calibration", default=None,
        help="per-op rates from `recscale bench calibrate` (default: this host's, if saved)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    tables = table_infos(cfg)
    topo = Topology(args.world_size, int(args.memory_per_rank * 1e9), args.all_to_all_gbps * 1e9,
                    args.all_to_all_gbps * 1e9, args.gather_gbps * 1e9,
                    ssd_per_rank=int(args.ssd_per_rank * 1e9),
                    ssd_bandwidth=args.ssd_gbps * 1e9,
                    host_per_rank=int(args.host_per_rank * 1e9))  # fmt: skip
    try:
        plan = plan_sharding(tables, topo, Constraints(batch_size=cfg.train.batch_size))
    except PlanError as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 1
    pred = _prediction(cfg, args)
    if args.json:
        out = plan.to_dict()
        if pred is not None:
            out["predicted_step_ms"] = pred.step_seconds * 1e3
            out["predicted_samples_per_s"] = pred.samples_per_s
            out["predicted_stage_ms"] = pred.stages_ms
        print(json.dumps(out, indent=1))
        return 0
    print(f"plan for {args.config}: {len(tables)} tables on {args.world_size} ranks "
          f"({args.memory_per_rank:g} GB each), global batch {cfg.train.batch_size}")  # fmt: skip
    print(f"{'table':>6} {'rows':>12} {'dim':>4} {'GB':>8}  {'placement':<14} ranks")
    for t, p in zip(tables, plan.placements):
        ranks = p.ranks if len(p.ranks) <= 8 else f"{p.ranks[:3]}..{p.ranks[-1]} ({len(p.ranks)})"
        where = (
            f"  {p.placement}, cache {p.cache_bytes / 1e9:.3f} GB"
            if p.placement != "device"
            else ""
        )
        print(
            f"{t.name:>6} {t.rows:>12,} {t.dim:>4} {t.bytes / 1e9:>8.3f}  {p.kind:<14} {ranks}{where}"
        )
    mem, cost = plan.memory_per_rank, plan.cost_per_rank
    print(f"memory per rank: max {max(mem) / 1e9:.2f} GB, min {min(mem) / 1e9:.2f} GB")
    print(f"embedding cost per step (lookup + update + all-to-all): slowest rank {plan.max_cost * 1e3:.3f} ms, "
          f"mean {sum(cost) / len(cost) * 1e3:.3f} ms, imbalance {plan.imbalance:.2f}")  # fmt: skip
    if pred is not None:
        stages = "  ".join(f"{k} {v:.2f}" for k, v in pred.stages_ms.items())
        print(
            f"predicted step per rank (performance model, this machine's calibration): "
            f"{pred.step_seconds * 1e3:.2f} ms, {pred.samples_per_s:,.0f} samples/s; stages (ms): {stages}"
        )
    else:
        print(
            "no calibration for this machine: `recscale bench calibrate` (a minute) lets plan "
            "predict step times"
        )
    return 0


def _prediction(cfg, args):
    """The performance model's step time for one rank, when a calibration exists."""
    from pathlib import Path

    from recscale.perfmodel import Calibration, default_path, predict

    path = Path(args.calibration) if args.calibration else default_path()
    if not path.exists():
        if args.calibration:
            raise SystemExit(f"recscale: error: --calibration {path}: no such file")
        return None
    return predict(cfg, Calibration.load(path), world_size=args.world_size)
