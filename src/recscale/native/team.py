"""Native kernel calls split over threads: on torch's OpenMP team when it can be had
(``native/team.c``), else over the Python pool of :func:`parallel_parts`.

Why the team: torch's OpenMP worker and our pool's thread would otherwise both want the
second core. Sleeping between ops, each wake of either costs ~50 us on a VM (config A's
step wakes them ~30 times); spinning, the OpenMP worker starves our thread. On one team
the worker runs both torch's ops and our parts, and spins through the gaps between them
(``GOMP_SPINCOUNT``, set in ``recscale/__init__.py``).

The split is :mod:`recscale.native.parallel`'s (the caller's share learned per call
site, or even where the parts' results are added up); part 0 runs on the calling thread
either way. The team serves the main thread only: libgomp gives every other calling
thread a team of its own, whose workers would compete with the main one's.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from recscale.native import parallel

USE_TEAM = True  # False: the Python pool (tests; measuring what the team gains)
_state: dict[str, object] = {}


def _torch_openmp() -> str | None:
    """The path of the libgomp that torch loaded (its own copy when it ships one)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    torch_dir = str(Path(torch.__file__).parent)
    paths = sorted(p for p in paths if p.startswith("/"))
    ours = [p for p in paths if p.startswith(torch_dir)]
    return (ours or paths or [None])[0]


def team_available(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s calls can run on torch's OpenMP team (asked once per process).
    Never in a forked child of a process that used it: libgomp's team does not survive
    ``fork`` (the child has the parent's bookkeeping but not its worker threads)."""
    if "why_not" not in _state:
        path = _torch_openmp()
        if os.environ.get("RECSCALE_TEAM", "1") == "0":
            _state["why_not"] = "RECSCALE_TEAM=0"
        elif not path or not lib.recscale_team_init(path.encode()):
            _state["why_not"] = "torch's libgomp not found"
        else:
            _state["why_not"] = None
        _state["pid"] = os.getpid()
    if _state["pid"] != os.getpid():
        return False
    return _state["why_not"] is None


def flush_denormals(lib: ctypes.CDLL | None) -> str:
    """Subnormal fp32 values taken as 0 (x86's FTZ and DAZ) on this thread and on every
    thread of torch's OpenMP team; in words, where it holds. ``torch.set_flush_denormal``
    alone sets the calling thread's only, and the team's workers, created by an earlier
    parallel region, would go on paying a microcode assist per subnormal operand
    (``native/team.c``). Threads created afterwards inherit the setting."""
    if not torch.set_flush_denormal(True):
        return "not on this CPU"
    threads = torch.get_num_threads()
    if threads == 1:
        return "on"
    if lib is not None and USE_TEAM and team_available(lib):
        if lib.recscale_team_flush_denormal(1, threads) == 0:
            return "on"
    return "on this thread and threads started from now"


def team_status(lib: ctypes.CDLL | None) -> str:
    """Where the native kernels' parts run, in words (for ``recscale bench``)."""
    if lib is None:
        return "no native kernels"
    if not USE_TEAM:
        return "parts on a Python thread pool (USE_TEAM off)"
    if not team_available(lib):
        return f"parts on a Python thread pool ({_state.get('why_not') or 'a forked child'})"
    spin = os.environ.get("GOMP_SPINCOUNT")
    return "parts on torch's OpenMP team" + (f" (GOMP_SPINCOUNT={spin})" if spin else "")


def _layout(lib: ctypes.CDLL, kernel: str) -> tuple[int, int, tuple[bool, ...] | None]:
    """(the team's id for ``kernel``, its argument count, which arguments are floats -
    None when none is)."""
    key = ("layout", kernel)
    if key not in _state:
        kid = lib.recscale_team_kernel_id(kernel.encode())
        argtypes = getattr(lib, kernel).argtypes
        if ctypes.c_double in argtypes:  # team.c passes floats as fp32 only
            raise TypeError(f"{kernel}: the team has no double arguments")
        is_float = tuple(t is ctypes.c_float for t in argtypes)
        _state[key] = (kid, len(argtypes), is_float if any(is_float) else None)
    return _state[key]  # type: ignore[return-value]


def _buffers(parts: int) -> tuple:
    """The team's per-part outputs - return codes, starts, durations (seconds), done
    flags - kept per part count: the team serves the main thread alone, one call at a
    time."""
    key = ("buffers", parts)
    if key not in _state:
        i64, f64 = ctypes.c_int64 * parts, ctypes.c_double * parts
        _state[key] = (i64(), f64(), f64(), i64())
    return _state[key]  # type: ignore[return-value]


def parallel_call(
    lib: ctypes.CDLL,
    kernel: str,
    n: int,
    args_of: Callable[[int, int, int], Sequence],
    threads: int,
    key: object = None,
    adaptive: bool = True,
) -> list[int]:
    """``lib.<kernel>(*args_of(part, lo, hi))`` over up to ``threads`` contiguous ranges of
    ``[0, n)``; returns each part's return value, in part order. ``args_of`` gives the
    kernel's whole argument list for one part (pointers as ints, None for NULL); ``key``
    and ``adaptive`` are :func:`recscale.native.parallel.parallel_parts`'s."""
    fn = getattr(lib, kernel)
    parts = max(1, min(threads, n))
    key = key if key is not None else getattr(args_of, "__code__", args_of)
    layout = (
        _layout(lib, kernel)
        if parts > 1
        and USE_TEAM
        and threading.current_thread() is threading.main_thread()
        and team_available(lib)
        else None
    )
    if layout is None or layout[0] < 0:  # (< 0: a kernel team.c does not list)
        out = [0] * parts

        def run(p: int, lo: int, hi: int) -> None:
            out[p] = fn(*args_of(p, lo, hi))

        parallel.parallel_parts(n, run, parts, key=key, adaptive=adaptive)
        return out
    kid, nargs, is_float = layout
    site, bounds = parallel.plan(n, parts, key, adaptive)
    ints: list[int] = []
    floats: list[float] = []
    for p in range(parts):
        args = args_of(p, bounds[p], bounds[p + 1])
        if len(args) != nargs:
            raise TypeError(f"{kernel} takes {nargs} arguments, got {len(args)}")
        if is_float:
            floats += [float(a) if f else 0.0 for a, f in zip(args, is_float)]
            ints += [0 if f or a is None else int(a) for a, f in zip(args, is_float)]
        else:
            ints += [0 if a is None else int(a) for a in args]
    buf = _buffers(parts)
    handed = time.perf_counter()
    rc = lib.recscale_team_run(
        kid,
        parts,
        nargs,
        (ctypes.c_int64 * len(ints))(*ints),
        (ctypes.c_float * len(floats))(*floats) if floats else None,
        *buf,
    )
    if rc != 0:
        raise RuntimeError(f"the OpenMP team cannot run {kernel}")
    began, took = list(buf[1]), list(buf[2])
    if site is not None:
        parallel.learn(site, n, bounds, handed, began, took)
    return list(buf[0])
