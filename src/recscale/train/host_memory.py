"""Host memory between steps: keep freed blocks in the process (``train.host_memory``).

glibc's malloc serves every block over its mmap threshold (at most 32 MB) with a
fresh ``mmap`` and gives it back with ``munmap`` on free. A training step makes and
drops the same large activations every time, so with the default each step maps them
again and the kernel faults in and zeroes every page once more - at MLPerf DLRMv2's
shapes (batch 16,384, [B, 3,456] fp32 activations of 226 MB) ~3.5 GB a step, 3-4 s
of kernel time a step on this 2-core VM (``recscale bench throughput``: 9.8 s a step
instead of 8.0 s; docs/performance.md).

``retain`` (the default) switches the mmap path off (``M_MMAP_MAX = 0``: large blocks
come from the heap like small ones) and lets the heap keep up to 2 GiB of free space
at its top (``M_TRIM_THRESHOLD``), so the next step reuses the pages it already has.
The price is the heap's fragmentation: the process's peak RSS can exceed what was
ever live at once (DCNv2 preset: 7.5 -> 10.2-11.1 GiB; config A: +2%; config B: none).
``system`` leaves malloc as it was. Only glibc has these knobs; elsewhere (musl,
macOS) both settings are the system's behaviour.

The mode applies from step 0 (``train/step.py::start_steps``); building the model, a
restore and a tier's warm start run under malloc's own behaviour (``setup_process``
sets ``system``). Retained, a tier's initialization - each table's rows drawn whole
(GBs), its ranks, the warm start's read buffers - was freed into the middle of the heap
and stayed resident: beyond RAM the process held 1.8-2.8 GB of such holes, memory the
page cache and the run need. What smaller blocks leave in the heap is handed back once
before step 0 (``release_free_memory``).
"""

from __future__ import annotations

import ctypes
import sys

from recscale.config.schema import HOST_MEMORY
from recscale.procfs import proc_bytes

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # malloc.h
_KEEP_AT_TOP = 2**31 - 1  # mallopt takes an int: the most it can be told (2 GiB)
_state = {"retain": False}


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (present in glibc only)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def set_host_memory(mode: str) -> bool:
    """Apply ``train.host_memory``; returns whether freed memory is now retained. Call it
    before the model is built (it governs blocks allocated after it)."""
    if mode not in HOST_MEMORY:
        raise ValueError(f"host memory mode {mode!r}; one of {', '.join(HOST_MEMORY)}")
    libc = _glibc()
    if libc is None:
        return False
    retain = mode == "retain"
    if retain != _state["retain"]:
        # "system" after "retain": glibc's default values back (mmap on, 128 KiB trim
        # threshold), though its dynamic threshold stays off once a value was set
        ok = libc.mallopt(_M_MMAP_MAX, 0 if retain else 65536) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_AT_TOP if retain else 128 * 1024) == 1
        _state["retain"] = retain and ok
    return _state["retain"]


def retained() -> bool:
    """Whether freed large blocks are now kept in the process (``retain`` in force)."""
    return _state["retain"]


def anon_memory() -> int:
    """This process's resident anonymous memory in bytes (``RssAnon``), or -1 where
    ``/proc`` does not say."""
    anon = proc_bytes("/proc/self/status", "RssAnon")
    return -1 if anon is None else anon


def release_free_memory() -> int:
    """Give the free pages inside malloc's heaps back to the system (glibc's
    ``malloc_trim(0)``: the middle of each heap, not only its top) and return the bytes
    of anonymous memory that went (0 where unknown or not glibc)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    before = anon_memory()
    libc.malloc_trim(0)
    after = anon_memory()
    return max(0, before - after) if before >= 0 and after >= 0 else 0
