"""``recscale train``: train a model and evaluate it; see recscale.train.run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recscale.config.loader import load_config, preset_names
from recscale.modules.embedding_bag_collection import IdOutOfRangeError
from recscale.train.run import TrainingDiverged, train


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: a small DLRM on synthetic Criteo-shaped data, about a minute)",
        epilog="Any config key can be overridden: --section.key=value (see `recscale config`).",
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"preset ({', '.join(preset_names())}) or TOML path; default: 'default'",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="where to write metrics and config (default runs/<timestamp>)",
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        metrics = train(cfg, run_dir)
    except (TrainingDiverged, IdOutOfRangeError) as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 1
    return 130 if metrics["interrupted"] else 0
