"""numba, configured once for coexistence with torch's OpenMP thread pool.

numba's default ``omp`` threading layer starts a second OpenMP runtime next to the
one bundled with torch; on a 2-core machine the two pools spin-wait against each
other and every torch op after a numba kernel slows down (config A: 43k -> 24k
samples/s, and even a plain GEMM measured afterwards loses a third of its rate).
The ``workqueue`` layer parks its workers instead. Import numba through here.
"""

from __future__ import annotations

import os

try:
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:  # an explicit user choice wins
        numba.config.THREADING_LAYER = "workqueue"
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None
    HAVE_NUMBA = False

__all__ = ["HAVE_NUMBA", "numba"]
