"""The environment torchrun sets (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR`` / ``MASTER_PORT`` where the ranks meet), read
and checked in one place. No torch: the embedding tier and the process set-up read the
host's share of cores and memory from it before any process group exists."""

from __future__ import annotations

import os


class JobLaunchError(RuntimeError):
    """The launch environment is malformed, or the ranks could not form the job (one
    started alone, a wrong ``MASTER_ADDR``). One line for the user."""


def env_int(name: str, default: int, least: int) -> int:
    """``os.environ[name]`` as a whole number >= ``least`` (``default`` when unset)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise JobLaunchError(
            f"environment variable {name}={raw!r}: a whole number >= {least} "
            "(torchrun sets it; unset it to train in one process)"
        )
    return value


def launch_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) from the environment torchrun sets, checked: whole
    numbers, and 0 <= RANK < WORLD_SIZE where there are several ranks."""
    world = env_int("WORLD_SIZE", 1, 1)
    rank, local_rank = env_int("RANK", 0, 0), env_int("LOCAL_RANK", 0, 0)
    if world > 1 and rank >= world:
        raise JobLaunchError(f"RANK={rank} is not below WORLD_SIZE={world}")
    return world, rank, local_rank


def check_rendezvous_env(world: int) -> None:
    """Where ``world`` > 1 ranks meet (torch's ``env://`` rendezvous): ``MASTER_ADDR``
    set and ``MASTER_PORT`` a port - torch's own errors for these are tracebacks."""
    if world <= 1:
        return
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise JobLaunchError(
            f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch the ranks with "
            "torchrun, or unset WORLD_SIZE to train in one process"
        )
    raw = os.environ.get("MASTER_PORT", "")
    port = env_int("MASTER_PORT", -1, 1)
    if not 1 <= port <= 65535:
        raise JobLaunchError(
            f"environment variable MASTER_PORT={raw!r}: a port in [1, 65535] (torchrun sets it)"
        )


def local_world_size() -> int:
    """How many ranks share this host (``LOCAL_WORLD_SIZE``, 1 when unset): they split its
    cores and its memory."""
    return env_int("LOCAL_WORLD_SIZE", 1, 1)
