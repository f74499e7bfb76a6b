"""Native C kernels (AVX2 + FMA; some AVX-512 where the CPU has it), called via ctypes.

``pip install`` compiles the ``*.c`` files here into the optional extension
``recscale.native._kernels`` (setup.py; a failed build is not fatal). The library is
loaded here with ctypes rather than imported: it has no Python API, only plain C
functions over raw fp32 pointers. :func:`parallel_call` (``native/team.py``) splits a
kernel call's work into parts run on torch's own OpenMP team (``native/team.c``), or
where that team cannot be had over Python threads (:func:`parallel_parts`,
``native/parallel.py``: ctypes releases the GIL during each call, so they run truly in
parallel).

Everything degrades: without the library (no compiler at install, another
architecture), on a CPU without AVX2/FMA, or with ``RECSCALE_NATIVE=0`` in the
environment, :func:`library` returns None and callers use their numba or torch path;
:func:`status` says which case applies. The AVX-512 kernels (the narrow first layer's
forward; the wider variants of the weight gradients and of the wide-vector interaction)
also need :func:`has_avx512`, else an AVX2 kernel, oneDNN or torch runs.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from pathlib import Path

import torch

from recscale.native.parallel import parallel_for, parallel_parts  # noqa: F401
from recscale.native.team import parallel_call  # noqa: F401

_ABI = 12
_lock = threading.Lock()
_loaded = False
_lib: ctypes.CDLL | None = None
_status = "not loaded"


def _find() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            return path
    return None


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.recscale_native_abi.restype = ctypes.c_int
    lib.recscale_cpu_supported.restype = ctypes.c_int
    lib.recscale_dot_forward.restype = ctypes.c_int
    lib.recscale_dot_forward.argtypes = [ptr, ptr, ptr] + [i64] * 10
    lib.recscale_dot_backward.restype = ctypes.c_int
    lib.recscale_dot_backward.argtypes = [ptr, ptr, ptr, ptr, ptr] + [i64] * 12
    f32 = ctypes.c_float
    lib.recscale_sparse_update.restype = ctypes.c_int
    lib.recscale_sparse_update.argtypes = (
        [i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64]
        + [f32] * 5
        + [ptr, i64, i64]
    )
    lib.recscale_avx512_supported.restype = ctypes.c_int
    lib.recscale_weight_grad.restype = ctypes.c_int
    lib.recscale_weight_grad.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr] + [i64] * 4
    lib.recscale_narrow_weight_grad.restype = ctypes.c_int
    lib.recscale_narrow_weight_grad.argtypes = [ptr, i64] * 4 + [ptr] + [i64] * 3
    lib.recscale_narrow_forward.restype = ctypes.c_int
    lib.recscale_narrow_forward.argtypes = [ptr, i64, ptr, i64, ptr, ptr] + [i64] * 5
    lib.recscale_logit_forward.restype = None
    lib.recscale_logit_forward.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr, i64, i64]
    lib.recscale_logit_backward.restype = None
    lib.recscale_logit_backward.argtypes = [ptr, i64] + [ptr] * 5 + [i64] * 3 + [ctypes.c_int]
    lib.recscale_pooled_lookup.restype = i64
    lib.recscale_pooled_lookup.argtypes = (
        [ptr, i64, ptr, ptr, i64, i64, i64, i64] + [ptr] * 6 + [i64]
    )
    lib.recscale_team_init.restype = ctypes.c_int
    lib.recscale_team_init.argtypes = [ctypes.c_char_p]
    lib.recscale_team_kernel_id.restype = i64
    lib.recscale_team_kernel_id.argtypes = [ctypes.c_char_p]
    lib.recscale_team_run.restype = ctypes.c_int
    lib.recscale_team_run.argtypes = [i64, i64, i64] + [ptr] * 6


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (see :func:`status` for why)."""
    global _loaded, _lib, _status
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            _lib, _status = _load()
            _loaded = True
    return _lib


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("RECSCALE_NATIVE", "1") == "0":
        return None, "disabled by RECSCALE_NATIVE=0"
    path = _find()
    if path is None:
        return None, "not built (pip install compiles it; needs a C compiler)"
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        return None, f"could not load {path.name}: {e}"
    if lib.recscale_native_abi() != _ABI:
        return None, f"{path.name} is from another version (reinstall: pip install -e .)"
    if not lib.recscale_cpu_supported():
        return None, "this CPU lacks AVX2/FMA/F16C"
    isa = "AVX2 + FMA + F16C" + (", AVX-512" if lib.recscale_avx512_supported() else "")
    return lib, f"loaded ({path.name}, {isa})"


# Row formats the embedding kernels read and write (native/row_format.h).
ROW_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def applies(t: torch.Tensor, dim: int, max_dim: int | None = None, rows: bool = False) -> bool:
    """Whether the kernels can run on ``t``: an fp32 CPU tensor (``rows``: or fp16/bf16
    embedding rows, at most 128 wide), a row width ``dim`` that is a multiple of 8 (one
    AVX2 vector), at most ``max_dim``, and the library loaded."""
    if rows and t.dtype != torch.float32:
        max_dim = min(max_dim or 128, 128)
    return (
        t.device.type == "cpu"
        and (t.dtype == torch.float32 or (rows and t.dtype in ROW_FORMATS))
        and dim > 0
        and dim % 8 == 0
        and (max_dim is None or dim <= max_dim)
        and library() is not None
    )


_avx512: bool | None = None


def has_avx512() -> bool:
    """Whether the library is loaded and this CPU (as its OS and hypervisor show it) runs
    its AVX-512 kernels. Asked once per process."""
    global _avx512
    if _avx512 is None:
        lib = library()
        _avx512 = lib is not None and bool(lib.recscale_avx512_supported())
    return _avx512


def status() -> str:
    library()
    return _status
