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
import re
import threading
from pathlib import Path

import torch

from recscale.native.parallel import parallel_for, parallel_parts  # noqa: F401
from recscale.native.team import parallel_call  # noqa: F401

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


HEADER = Path(__file__).with_name("recscale_native.h")
_CTYPES = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "void": None,
}


def _ctype(decl: str):
    """The ctypes type of a C parameter or return type in the header's subset."""
    decl = decl.strip()
    if "*" in decl:
        return (
            ctypes.c_char_p if re.match(r"(const\s+)?char\s*\*\s*\w*$", decl) else ctypes.c_void_p
        )
    base = re.sub(r"\bconst\b", "", decl).split()[0]
    if base not in _CTYPES:
        raise ValueError(f"{HEADER.name}: no ctypes type for {decl!r}")
    return _CTYPES[base]


def header_signatures(text: str | None = None) -> dict[str, tuple[object, list]]:
    """``name -> (restype, argtypes)`` of the functions between the header's python
    markers: the library's Python interface, declared once (``recscale_native.h``)."""
    text = HEADER.read_text() if text is None else text
    block = text.split("/* @python-begin */", 1)[1].split("/* @python-end */", 1)[0]
    block = re.sub(r"/\*.*?\*/", "", block, flags=re.S)
    out = {}
    for ret, name, params in re.findall(
        r"([\w\s\*]+?)\s*\b(recscale_\w+)\s*\(([^)]*)\)\s*;", block
    ):
        args = [] if params.strip() == "void" else [_ctype(x) for x in params.split(",")]
        out[name] = (_ctype(ret), args)
    return out


def header_abi() -> int:
    return int(re.search(r"#define RECSCALE_NATIVE_ABI (\d+)", HEADER.read_text()).group(1))


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in header_signatures().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


# recscale_cpu_features()'s bits (recscale_native.h)
CPU_AVX2, CPU_AVX512F, CPU_AVX512_BF16, CPU_AMX_BF16 = 1, 2, 4, 8


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
        abi = lib.recscale_native_abi()
        if abi != header_abi():
            return None, f"{path.name} is from another version (reinstall: pip install -e .)"
        _declare(lib)
    except (OSError, AttributeError, ValueError) as e:
        return None, f"could not load {path.name}: {e}"
    features = lib.recscale_cpu_features()
    if not features & CPU_AVX2:
        return None, "this CPU lacks AVX2/FMA/F16C"
    isa = "AVX2 + FMA + F16C" + "".join(
        f", {n}"
        for bit, n in (
            (CPU_AVX512F, "AVX-512"),
            (CPU_AVX512_BF16, "AVX512-BF16"),
            (CPU_AMX_BF16, "AMX-BF16"),
        )
        if features & bit
    )
    return lib, f"loaded ({path.name}, {isa})"


# Row formats the embedding kernels read and write (native/row_format.h).
ROW_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ROW_SPLIT = 3  # bf16 high halves with the low 16 bits apart (Split-SGD-BF16): exact


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


def cpu_features() -> int:
    """``CPU_*`` bits of this CPU as its OS and hypervisor show it (0 without the library)."""
    lib = library()
    return lib.recscale_cpu_features() if lib is not None else 0


def has_avx512() -> bool:
    """Whether the library is loaded and this CPU runs its AVX-512 kernels."""
    return bool(cpu_features() & CPU_AVX512F)


def status() -> str:
    library()
    return _status
