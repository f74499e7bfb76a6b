"""The Zipf law of synthetic ids as plain arithmetic (no numpy, no torch): what share of
the draws of ``synthetic.zipf_ranks`` (P(rank r) ~ (r + 1)^-alpha over n ranks) the most
popular k ranks take. The planner reads a cache's hit rate from it."""

from __future__ import annotations

import math


def zipf_share(k: float, n: int, alpha: float) -> float:
    """The share of :func:`zipf_ranks`' draws that fall on the ``k`` most popular of
    ``n`` ranks (its exact CDF at rank k): the hit rate of a cache of those rows."""
    k = min(max(k, 0.0), float(n))
    if alpha == 0.0:
        return k / n
    if abs(alpha - 1.0) < 1e-9:
        return math.log(k + 1) / math.log(n + 1)
    e = 1.0 - alpha
    return ((k + 1) ** e - 1.0) / ((n + 1) ** e - 1.0)
