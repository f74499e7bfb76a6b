"""The one place that decides which kernel runs an embedding or interaction op.

``model.kernels`` asks for one (``config.schema.KERNELS``); ``auto`` takes the first
that applies, in this order::

    native   C + AVX2 (recscale.native): fp32 CPU tensors (embedding rows: fp16 and bf16
             too), dim a multiple of 8
    triton   Triton (embedding/triton_kernels.py): fp32 CUDA tensors (or CPU tensors
             under TRITON_INTERPRET=1, which is how CI tests them), triton installed
    numba    numba JIT (CPU): fp32 CPU tensors
    torch    plain torch ops on any device: the reference every other kernel is tested
             against, and the last fallback

Asking for a kernel by name that cannot run on the tensors at hand is an error that
says why (``_STRICT``), except the native lookup and update, which leave tables they
cannot take (a dim that is not a multiple of 8) to the next kernel in the order.
"""

from __future__ import annotations

import functools
import os

import torch

from recscale import native
from recscale.config.errors import ConfigError
from recscale.config.schema import KERNELS

__all__ = ["KERNELS", "choose", "choose_once", "triton_available", "triton_interpreting"]

# Which ops each kernel family implements.
_IMPLEMENTS = {
    "lookup": ("native", "triton", "torch"),
    "backward": ("native", "triton", "numba", "torch"),
    "interaction": ("native", "numba", "torch"),
}

# Asked for by name, these must run (else an error); the others fall back down the order
# for the tables they cannot take (the native lookup and update need a dim % 8 == 0).
_STRICT = {
    "interaction": ("native", "numba"),
    "backward": ("numba", "triton"),
    "lookup": ("triton",),
}


@functools.lru_cache(maxsize=1)
def _triton_import() -> str | None:
    """None when ``import triton`` works, else the reason it does not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not available
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def triton_interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors (tests, CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    return _triton_import() is None


def _applies(kernel: str, op: str, t: torch.Tensor, dim: int, max_dim: int | None) -> str | None:
    """None if ``kernel`` can run ``op`` on ``t``, else why not."""
    if kernel not in _IMPLEMENTS[op]:
        return f"there is no {kernel} kernel for the {op}"
    if kernel == "torch":
        return None
    # The interaction kernels read any [B, F, D] strides; the embedding ones want rows.
    contiguous = op == "interaction" or t.is_contiguous()
    if kernel == "native":
        if native.applies(t, dim, max_dim, rows=op != "interaction") and contiguous:
            return None
        return (
            f"the native kernels need recscale.native ({native.status()}), contiguous "
            "fp32 CPU tensors and a dim that is a multiple of 8"
        )
    if kernel == "triton":
        if not triton_available():
            return _triton_import()
        on_device = t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting())
        if on_device and t.dtype == torch.float32 and contiguous:
            return None
        return "the Triton kernels need contiguous fp32 CUDA tensors (or TRITON_INTERPRET=1)"
    # numba
    from recscale.embedding.cpu_kernels import HAVE_NUMBA

    if HAVE_NUMBA and t.device.type == "cpu" and t.dtype == torch.float32 and contiguous:
        return None
    return "the numba kernels need numba and contiguous fp32 CPU tensors"


def choose(requested: str, op: str, t: torch.Tensor, dim: int, max_dim: int | None = None) -> str:
    """The kernel that runs ``op`` (lookup | backward | interaction) on tensors like ``t``
    (row width ``dim``): ``requested`` itself, or for ``auto`` the first that applies.
    Under ``auto`` Triton is taken on CUDA only: on CPU the interpreter is a test tool."""
    if requested not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {requested!r}")
    order = _IMPLEMENTS[op]
    if requested != "auto":
        why = _applies(requested, op, t, dim, max_dim)
        if why is None:
            return requested
        if requested not in order:
            return "torch"  # e.g. kernels=numba: the lookup has no numba kernel, torch pools
        if requested in _STRICT.get(op, ()):
            raise ConfigError("model.kernels", f"{requested}: {why}")  # one line, not a traceback
        order = order[order.index(requested) + 1 :]  # a table the kernel cannot take: the next
    for kernel in order:
        if kernel == "triton" and t.device.type != "cuda":
            continue
        if _applies(kernel, op, t, dim, max_dim) is None:
            return kernel
    return "torch"


def choose_once(
    owner: object, requested: str, op: str, t: torch.Tensor, dim: int, max_dim: int | None = None
) -> str:
    """:func:`choose`, decided once per ``owner`` (a storage, an interaction) and per
    (op, device, dtype) - what the decision depends on for a given owner - instead of at
    every call of a step."""
    memo = owner.__dict__.setdefault("_kernel_choices", {})
    key = (op, t.device, t.dtype, max_dim)
    kernel = memo.get(key)
    if kernel is None:
        kernel = memo[key] = choose(requested, op, t, dim, max_dim)
    return kernel
