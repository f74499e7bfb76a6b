"""``recscale`` command line: parse, build, run. Subcommands live in their own modules."""

from __future__ import annotations

import argparse
import sys

from recscale.cli import (
    bench_cmd,
    checkpoint_cmd,
    config_cmd,
    data_cmd,
    eval_cmd,
    plan_cmd,
    train_cmd,
)
from recscale.config.errors import ConfigError
from recscale.data.dataset import DatasetError
from recscale.embedding.cached_storage import TierFileError
from recscale.embedding.storage import DevicePlacementError
from recscale.locks import LockedError
from recscale.train.config_agreement import RankFailed

COMMANDS = {
    "train": train_cmd,
    "eval": eval_cmd,
    "data": data_cmd,
    "plan": plan_cmd,
    "bench": bench_cmd,
    "checkpoint": checkpoint_cmd,
    "config": config_cmd,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recscale",
        description="Train deep learning recommendation models (DLRM family) fast.",
        epilog="Config overrides: --section.key=value, e.g. --model.embedding_dim=64 "
        "--train.steps=100",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].run(args, extra)
    except ConfigError as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 2
    except (DatasetError, TierFileError, DevicePlacementError) as e:
        # bad input files, an unusable ssd_dir, a table's tensor off its planned device
        print(f"recscale: error: {e}", file=sys.stderr)
        return 1
    except (LockedError, RankFailed) as e:  # another process writes the run directory /
        # the dataset; another rank of this job failed to set up (it says why)
        print(f"recscale: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a path that cannot be read or written
        where = f"{e.filename}: " if e.filename and str(e.filename) not in str(e.strerror) else ""
        print(f"recscale: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the training loop (which handles its own)
        print("recscale: interrupted", file=sys.stderr)
        return 130
