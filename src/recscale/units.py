"""Sizes as a person reads them, one rule for every message: ``2.32 GB``, ``163.26 kB``.
A debug model's tables and a test's disks are kB: "0.00 GB" would say nothing."""

from __future__ import annotations


def size_text(n: float) -> str:
    """``n`` bytes in the largest of GB, MB and kB it reaches (two decimals), else bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} bytes"
