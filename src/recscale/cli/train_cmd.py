"""``recscale train``: train a model and evaluate it; see recscale.train.run."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from recscale.cli import signals
from recscale.cli.output import print_error
from recscale.config.errors import ConfigError
from recscale.config.loader import load_config, parse_overrides, preset_names
from recscale.config.small_files import loads_json, read_small_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: a small DLRM on synthetic Criteo-shaped data, ~a minute)",
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
    p.add_argument(
        "--resume",
        default=None,
        type=Path,
        help="continue from RUN_DIR (its newest valid checkpoint and its config) "
        "or a checkpoint directory",
    )


def run_dir_of(path: Path) -> Path | None:
    """A run directory, its checkpoints/ folder, or one checkpoint -> the run directory
    (the nearest with a config.toml, ``path`` or up to two levels up), or None."""
    for d in (path, path.parent, path.parent.parent):
        if (d / "config.toml").exists():
            return d
    return None


def _finished_at(run_dir: Path, steps: int) -> int | None:
    """The step a run that finished in ``run_dir`` (its metrics.json: not interrupted)
    reached, where that is at or past ``steps``; else None (0 steps: derived from epochs
    when the run starts, unknown here). Under torchrun not asked: a node without the run
    directory would go on alone into the job's collectives."""
    try:
        m = loads_json(read_small_text(run_dir / "metrics.json", "--resume"))
    except (ConfigError, ValueError):  # none, or not one this run wrote whole
        return None
    done = m.get("steps") if isinstance(m, dict) else None
    if steps and m.get("interrupted") is False and isinstance(done, int) and done >= steps:
        return done
    return None


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    # Imported here, not at the top: `recscale --help` and the other commands need
    # neither torch nor the training stack (seconds of imports).
    from recscale.checkpoint.format import CheckpointError
    from recscale.distributed.pipeline import InputStalled
    from recscale.embedding.cached_storage import CacheTooSmallError
    from recscale.launch_env import launch_env
    from recscale.modules.id_checks import IdOutOfRangeError
    from recscale.train.data_source import refuse_keys_a_dataset_overrules
    from recscale.train.run import RunDirInUse, TrainingDiverged, train

    resume_dir = None
    if args.resume is not None:
        resume_dir = run_dir_of(args.resume)
        if resume_dir is None:
            print_error(f"--resume {args.resume}: no config.toml in it or above it")
            return 1
    config = args.config or (str(resume_dir / "config.toml") if resume_dir else None)
    try:
        cfg = load_config(config, overrides, saved=args.config is None and resume_dir is not None)
    except ConfigError as e:
        if e.key == "--config" and args.config is None and resume_dir is not None:
            raise ConfigError("--resume", e.message) from None  # the file --resume named
        raise
    refuse_keys_a_dataset_overrules(cfg, (key for key, _ in parse_overrides(overrides)))
    if args.run_dir:
        run_dir = Path(args.run_dir)
    elif resume_dir is not None:
        run_dir = resume_dir
    else:
        run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        n = 1
        while run_dir.exists():  # two runs started within the same second
            n += 1
            run_dir = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    if resume_dir is not None and run_dir == resume_dir and launch_env()[0] == 1:
        done = _finished_at(run_dir, cfg.train.steps)
        if done is not None:  # resuming would train nothing and rewrite its record
            # a checkpoint named inside the run: its steps past it are another timeline
            branch = args.resume.resolve() != run_dir.resolve()
            how = (
                f"to train on from {args.resume}, give it a --run-dir of its own"
                if branch
                else "raise --train.steps to continue"
            )
            print(
                f"recscale: {run_dir} finished at step {done:,} (train.steps "
                f"{cfg.train.steps:,}): nothing to train; {how} "
                "(its metrics.json and checkpoints are left as they are)",
                file=sys.stderr,
            )
            return 0
    made_here = not run_dir.exists()
    try:
        metrics = train(cfg, run_dir, resume=args.resume)
    except (
        TrainingDiverged,
        IdOutOfRangeError,
        CheckpointError,
        RunDirInUse,
        CacheTooSmallError,
        InputStalled,
    ) as e:
        print_error(e)
        return 1
    finally:
        if made_here:  # a run that failed before writing leaves no empty directory behind
            for d in (run_dir / "embeddings", run_dir):  # the ssd tier's, planned in
                with contextlib.suppress(OSError):  # not empty (or gone): left as it is
                    d.rmdir()
    if signals.terminated() or metrics.get("stop_signal") == "SIGTERM":
        print("recscale: terminated (SIGTERM); stopped cleanly", file=sys.stderr)
        return 143
    return 130 if metrics["interrupted"] else 0
