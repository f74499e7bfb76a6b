"""Linux's ``/proc`` key files (``/proc/meminfo``, ``/proc/self/status``,
``/proc/cpuinfo``): one reader."""

from __future__ import annotations

import os


def cpuinfo_field(key: str) -> str:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (``vendor_id``, ``flags``), or
    "" where there is no such file or line (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``),
    or "" where it names none."""
    return cpuinfo_field("vendor_id")


def proc_bytes(path: str, key: str) -> int | None:
    """The value of ``key`` (``MemAvailable``, ``RssAnon``...) in a ``/proc`` file whose
    lines read ``Key:   1234 kB``, in bytes; None where the file or the key is missing
    (not Linux, an older kernel)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available() -> int:
    """The host's MemAvailable (bytes), else its free pages."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
