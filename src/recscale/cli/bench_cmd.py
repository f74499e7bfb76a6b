"""``recscale bench throughput --config A|B|NAME [--json]`` and
``recscale bench pipeline --config NAME --world-size N`` (N local gloo ranks)."""

from __future__ import annotations

import argparse
import json
import sys

from recscale.config.loader import load_config, preset_names


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure training throughput against the hardware bound")
    p.add_argument("what", choices=["throughput", "pipeline"])
    p.add_argument(
        "--config", default="A", help=f"preset ({', '.join(preset_names())}) or TOML path"
    )
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--world-size", type=int, default=2, help="pipeline: local ranks")
    p.add_argument("--threads", type=int, default=1, help="pipeline: torch threads per rank")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from recscale.bench.throughput import format_report, run_throughput

    cfg = load_config(args.config, overrides)
    if args.what == "pipeline":
        from recscale.bench.distributed import format_pipeline_report, run_pipeline_bench

        r = run_pipeline_bench(cfg, args.world_size, args.steps, args.warmup, args.threads)
        r["config"] = args.config
        print(json.dumps(r, indent=2) if args.json else format_pipeline_report(args.config, r))
        return 0
    echo = (lambda s: print(s, file=sys.stderr)) if args.json else print
    result = run_throughput(cfg, steps=args.steps, warmup=args.warmup, echo=echo)
    result["config"] = args.config
    print(json.dumps(result, indent=2) if args.json else format_report(args.config, result))
    return 0
