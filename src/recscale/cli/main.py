"""``recscale`` command line: parse, build, run. Subcommands live in their own modules."""

from __future__ import annotations

import argparse
import os
import re
import select
import sys

from recscale.cli import (
    bench_cmd,
    checkpoint_cmd,
    config_cmd,
    data_cmd,
    eval_cmd,
    plan_cmd,
    signals,
    train_cmd,
)
from recscale.cli.output import escaped_output, print_error
from recscale.config.errors import ConfigError
from recscale.locks import LockedError

COMMANDS = {
    "train": train_cmd,
    "eval": eval_cmd,
    "data": data_cmd,
    "plan": plan_cmd,
    "bench": bench_cmd,
    "checkpoint": checkpoint_cmd,
    "config": config_cmd,
}


# Errors that are the user's to fix, each one line and exit 1: bad input files, an
# unusable ssd_dir, a table's tensor off its planned device, another rank of the job
# that failed to set up (it says why), ranks that could not form the job. Looked up
# among the modules loaded, not imported: an error of a module never imported cannot
# have been raised, and `--help` and `config` need neither torch nor the training
# stack (seconds of imports).
USER_ERRORS = (
    ("recscale.config.errors", "EnvironmentSettingError"),
    ("recscale.data.columns", "DatasetError"),
    ("recscale.embedding.cache_stats", "CacheTooSmallError"),
    ("recscale.embedding.row_file", "TierFileError"),
    ("recscale.embedding.storage", "DevicePlacementError"),
    ("recscale.train.config_agreement", "RankFailed"),
    ("recscale.launch_env", "JobLaunchError"),
)


def _is_user_error(e: BaseException) -> bool:
    for module, name in USER_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(e, getattr(loaded, name)):
            return True
    return False


def _stdout_closed() -> bool:
    """Whether standard output's reader went away (a pipe's write end polls as an error
    then); if so, output goes to /dev/null from now on, so the exit's flush is quiet."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        closed = any(ev & select.POLLERR for _fd, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (captured, closed)
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


def _refuse_empty_values(args: argparse.Namespace) -> None:
    """A flag given an empty value (``--config ""``, ``--run-dir "$UNSET"``) is refused,
    naming it: read as the flag left out, it trained the default preset, wrote to a
    default place or scored the default split without a word."""
    for dest, value in vars(args).items():
        if isinstance(value, str) and not value.strip():
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(flag, "an empty value: give one, or leave the flag out")


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


def _open_closed_standard_streams() -> None:
    """A standard descriptor the caller closed (``recscale train >&-``) is opened on
    /dev/null. Left closed, Python has no ``sys.stdout`` (the first print was an
    AttributeError mid-run, leaving a run directory no rerun could use), and the next
    file the run opens takes its number: a C library's message to fd 2 (OpenMP's, torch's)
    would land in a log or checkpoint file."""
    for fd in (0, 1, 2):  # in order: os.open takes the lowest free number, this one
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode))  # noqa: SIM115 - for the process


def main(argv: list[str] | None = None) -> int:
    _open_closed_standard_streams()
    with escaped_output():  # no path or value printed can rewrite the terminal
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        _refuse_empty_values(args)
        with signals.sigterm_as_interrupt():
            rc = COMMANDS[args.command].run(args, extra)
            sys.stdout.flush()  # a reader gone: the error comes here, to the clause below
            return rc
    except ConfigError as e:
        print_error(e)
        return 2
    except LockedError as e:  # another process writes the run directory / the dataset
        print_error(e)
        return 1
    except BrokenPipeError as e:
        if _stdout_closed():  # `recscale plan | head`: the reader has all it wanted
            return 141  # 128 + SIGPIPE, as a shell tool stopped by the pipe
        print_error(e.strerror or e)
        return 1
    except OSError as e:  # a full disk, a path that cannot be read or written
        where = f"{e.filename}: " if e.filename and str(e.filename) not in str(e.strerror) else ""
        print_error(f"{where}{e.strerror or e}")
        return 1
    except Exception as e:  # after OSError: these are not OS errors
        # pathlib's resolve() on a loop of links raises this RuntimeError (Python < 3.13)
        loop = re.fullmatch(r"Symlink loop from '(.*)'", str(e), re.DOTALL)
        if loop is not None and type(e) is RuntimeError:
            print_error(f"{loop.group(1)}: a loop of symbolic links")
            return 1
        if not _is_user_error(e):
            raise
        print_error(e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM outside the training loop (it has its own)
        if signals.terminated():
            print("recscale: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print("recscale: interrupted", file=sys.stderr)
        return 130
