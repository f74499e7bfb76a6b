"""``recscale bench throughput --config A|B|NAME [--json]``,
``recscale bench pipeline --config NAME --world-size N`` (N local gloo ranks) and
``recscale bench sweep --vary section.key=v1,v2 [--vary ...] --out DIR``."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from recscale.config.errors import ConfigError
from recscale.config.loader import load_config, preset_names
from recscale.config.small_files import json_text, kind_of, loads_json, read_small_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure training throughput against the hardware bound")
    p.add_argument("what", choices=["throughput", "pipeline", "sweep", "calibrate"])
    p.add_argument(
        "--config",
        default=None,
        help=f"preset ({', '.join(preset_names())}) or TOML path (default A; sweep: default)",
    )
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="pipeline: local ranks (default 2); calibrate: fit whole steps on "
        "this many local ranks (predicting W local ranks; default 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pipeline: torch threads per rank (default 1); calibrate: threads to "
        "measure the ops on (default: torch's)",
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        help="sweep: section.key=v1,v2,... (repeat for a grid; a list value in brackets: "
        "model.top_mlp=[256,1],[512,256,1])",
    )
    p.add_argument(
        "--out",
        default=None,
        help="sweep: directory for results.csv and plots; calibrate: the JSON file "
        "(default ~/.cache/recscale/calibration-HOST.json)",
    )


# Local ranks `bench pipeline` / `calibrate` start as processes on this machine: more
# than this is a typo, not a benchmark (each rank is a full process with its model).
MAX_LOCAL_RANKS = 64
# Steps a benchmark times or warms up with: a billion steps of the smallest model is
# months of one core, so more is a typo (it ran, silent, until killed).
MAX_BENCH_STEPS = 10**9


# The flags each benchmark reads beyond --config, --steps, --warmup and --json.
FLAGS_OF = {
    "throughput": (),
    "pipeline": ("world_size", "threads"),
    "sweep": ("vary", "out"),
    "calibrate": ("world_size", "threads", "out"),
}


def check_args(args: argparse.Namespace) -> None:
    """One-line errors naming the flag for counts no benchmark can run with."""
    if not 1 <= args.steps <= MAX_BENCH_STEPS:
        raise ConfigError("--steps", f"timed steps in [1, {MAX_BENCH_STEPS:,}], got {args.steps:,}")
    if not 0 <= args.warmup <= MAX_BENCH_STEPS:
        raise ConfigError("--warmup", f"in [0, {MAX_BENCH_STEPS:,}], got {args.warmup:,}")
    if args.world_size is not None and not 1 <= args.world_size <= MAX_LOCAL_RANKS:
        raise ConfigError(
            "--world-size", f"local ranks in [1, {MAX_LOCAL_RANKS}], got {args.world_size}"
        )
    if args.what == "pipeline" and args.world_size == 1:  # one rank has no input all-to-all
        raise ConfigError(  # to overlap (it failed in the ranks, a traceback)
            "--world-size",
            "bench pipeline times the input all-to-all of 2 or more ranks (one process: "
            "bench throughput)",
        )
    for flag, attr in (
        ("--world-size", "world_size"),
        ("--threads", "threads"),
        ("--vary", "vary"),
        ("--out", "out"),
    ):
        takes = [w for w, flags in FLAGS_OF.items() if attr in flags]
        if getattr(args, attr) not in (None, []) and args.what not in takes:
            raise ConfigError(  # else it would be ignored without a word
                flag,
                f"bench {args.what} does not take it (bench {' and '.join(takes)} "
                + ("do" if len(takes) > 1 else "does")
                + ("; the step's own threads: --train.threads)" if attr == "threads" else ")"),
            )
    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= 4 * cores:
        raise ConfigError(
            "--threads",
            f"in [1, {4 * cores}] (4x this machine's {cores} cores), got {args.threads}",
        )


def _check_writable(path: Path, key: str) -> None:
    """``path`` can be written: not a directory, its folder made and writable (a file
    made and removed there)."""
    if path.is_dir():
        raise ConfigError(key, f"{path} is a directory; name the file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".recscale-"):
            pass
    except OSError as e:
        raise ConfigError(key, f"cannot write in {path.parent}: {e.strerror or e}") from None


def _refuse_replacing_another_file(path: Path) -> None:
    """``bench calibrate --out`` replaces a calibration (an older one, of any format)
    and nothing else: a dataset's metadata.json or a config named by a slip of the path
    was overwritten, lost."""
    if not path.exists():
        return
    try:
        d = loads_json(read_small_text(path, "--out"))
    except (ConfigError, ValueError):
        d = None
    if not (isinstance(d, dict) and "laws" in d and "machine" in d):
        raise ConfigError(
            "--out",
            f"{path} exists and is not a calibration; it is left alone: remove it or name "
            "another file",
        )


def _synthetic_only(cfg, what: str) -> None:
    """The benchmarks time training steps on synthetic batches of the config's shapes: a
    dataset named to them would be ignored without a word."""
    if cfg.data.uses_dataset():
        raise ConfigError(
            "data.path",
            f"bench {what} times the training step on synthetic batches of the config's "
            f"shapes and reads no dataset ({cfg.data.path}): train with --data.path to time "
            "training from it (metrics.json holds its samples/s), or give the dataset's "
            "table sizes as --model.table_sizes",
        )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from recscale.bench.throughput import format_report, run_throughput

    check_args(args)
    if args.what == "calibrate" and (args.config or overrides):
        given = "--config" if args.config else overrides[0].split("=", 1)[0]
        raise ConfigError(
            given,
            "bench calibrate times a fixed set of shapes of its own (docs/perfmodel.md) and "
            "reads no config; its flags are --out, --threads and --world-size",
        )
    if args.what == "calibrate":
        from recscale.bench.calibrate import calibrate
        from recscale.perfmodel import default_path

        path = Path(args.out) if args.out else default_path()
        _check_writable(path, "--out")  # before minutes of measuring, not after
        _refuse_replacing_another_file(path)
        cal = calibrate(threads=args.threads, world_size=args.world_size or 1)
        cal.save(path)
        for name, law in cal.laws.items():
            print(f"  {name:<14} fit error (median) {law.fit_error:.1%}")
        print(f"wrote {path} (recscale plan uses it to predict step times)")
        return 0
    if args.what == "sweep":
        from recscale.bench.sweep import parse_vary, run_sweep

        if not args.out:
            print("recscale: error: bench sweep needs --out DIR", file=sys.stderr)
            return 2
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ConfigError(
                "--out", f"{args.out} is {kind_of(args.out)}; name a directory for the sweep"
            )
        varies = parse_vary(args.vary, args.config)
        _synthetic_only(load_config(args.config, overrides), "sweep")  # as run_sweep
        if any(key == "data.path" for key, _ in varies):
            raise ConfigError("--vary", "data.path: a sweep runs on synthetic batches only")
        steps = args.steps if args.steps != 50 else 20  # a sweep point needs fewer
        rows = run_sweep(args.config, varies, Path(args.out), steps, min(args.warmup, 5), overrides)
        return 1 if all(r.get("error") for r in rows) else 0
    args.config = args.config or "A"
    cfg = load_config(args.config, overrides)
    _synthetic_only(cfg, args.what)
    if args.what == "pipeline":
        from recscale.bench.distributed import format_pipeline_report, run_pipeline_bench

        r = run_pipeline_bench(
            cfg, args.world_size or 2, args.steps, args.warmup, args.threads or 1
        )
        r["config"] = args.config
        print(json_text(r, indent=2) if args.json else format_pipeline_report(args.config, r))
        return 0
    echo = (lambda s: print(s, file=sys.stderr)) if args.json else print
    result = run_throughput(cfg, steps=args.steps, warmup=args.warmup, echo=echo)
    result["config"] = args.config
    print(json_text(result, indent=2) if args.json else format_report(args.config, result))
    return 0
