"""Run a function on N local ranks joined by gloo over loopback (tests, benchmarks).

The same environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so the function initialises exactly as a
torchrun worker does (:func:`recscale.distributed.init_distributed`).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before it forks a rank (``process_context``)
_PRELOAD = ["recscale", "torch", "torch.distributed", "torch._dynamo"]


def also_preload(*modules: str) -> None:
    """Modules the fork server imports besides torch and recscale's package, for a caller
    whose ranks import more (the tests: ``recscale.train.run``, 1.2 s a rank on a
    2-vCPU host). Takes effect where called before the server starts (its first rank)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def process_context():
    """Ranks fork from a server that imported torch and recscale once (the ``forkserver``
    start method): each rank then starts in ~0.1 s instead of the 2-3 s an import of
    torch takes on a fresh interpreter (``spawn``, where the platform has no forkserver).
    The server imports only modules and runs no torch op, so it holds no thread pool a
    fork would break (torch's and numba's start at their first parallel call; the
    native kernels' OpenMP team is taken per process, ``native/team.py``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: DistributedDataParallel's constructor reads its settings (an
    # import of 1.7 s on a 2-vCPU host, in every rank without it)
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker(rank, world, port, fn, args, queue, environ, passthrough) -> None:
    # The server's environment is the one it started with: the ranks see the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        # Results travel as bytes: tensors shared through file descriptors would vanish
        # with the process that made them.
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        raised = None
        if isinstance(e, passthrough):
            with contextlib.suppress(Exception):  # an error that does not pickle: text only
                raised = pickle.dumps(e)
        queue.put((rank, False, (traceback.format_exc(), raised)))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300,
    passthrough: tuple[type[BaseException], ...] = (),
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` fresh processes; returns their results by rank.

    Raises RuntimeError with the failing ranks' tracebacks; a rank that exits without
    reporting (killed) or a job that outlives ``timeout`` seconds is an error too. An
    error of a ``passthrough`` type (a config the ranks refused) is raised as itself -
    the lowest rank's, from that RuntimeError - so a caller reports it as it would in
    one process; the other ranks then fail only because it left.
    """
    ctx = process_context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, environ, passthrough)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    passed: dict[int, BaseException] = {}

    def failed(rank: int, value: tuple[str, bytes | None]) -> None:
        text, raised = value
        errors.append(f"rank {rank}:\n{text}")
        if raised is not None:
            passed[rank] = pickle.loads(raised)

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f}s")
                    break
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    time.sleep(2.0)  # let the survivors report their own errors
                    while not queue.empty():
                        rank, ok, value = queue.get()
                        if not ok:
                            failed(rank, value)
                    errors.append(
                        f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}"
                    )
                    break
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failed(rank, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        detail = RuntimeError("distributed run failed:\n" + "\n".join(errors))
        if passed:
            raise passed[min(passed)] from detail
        raise detail
    return [results[r] for r in range(world_size)]
