"""numba, configured once for coexistence with torch's OpenMP thread pool.

numba's default ``omp`` threading layer starts a second OpenMP runtime next to the
one bundled with torch; on a 2-core machine the two pools spin-wait against each
other and every torch op after a numba kernel slows down (config A: 43k -> 24k
samples/s, and even a plain GEMM measured afterwards loses a third of its rate).
The ``workqueue`` layer parks its workers instead. Import numba through here.
"""

from __future__ import annotations

import os

from recscale.config.errors import EnvironmentSettingError

# NUMBA_THREADING_LAYER's values (numba's docs): the named layers and the behaviours
LAYERS = ("workqueue", "omp", "tbb", "default", "safe", "forksafe", "threadsafe")


def check_numba_environment() -> None:
    """numba's own variables checked before it reads them: ``NUMBA_NUM_THREADS=0`` made
    numba's import raise (a traceback from any command), ``abc`` printed a warning
    with a traceback in it, and an unknown or missing threading layer raised at the
    first parallel kernel, mid-run."""
    for name in ("NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER"):
        if not os.environ.get(name, "x").strip():  # set empty: numba's default, unwarned
            del os.environ[name]
    raw = os.environ.get("NUMBA_NUM_THREADS", "")
    if raw:
        try:
            ok = int(raw) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise EnvironmentSettingError(
                "NUMBA_NUM_THREADS", raw, "a whole number >= 1 (numba's threads; unset: all cores)"
            )
    layer = os.environ.get("NUMBA_THREADING_LAYER", "")
    if layer and layer not in LAYERS:
        raise EnvironmentSettingError(
            "NUMBA_THREADING_LAYER", layer, f"one of {', '.join(LAYERS)} (unset: workqueue)"
        )


def _check_tbb() -> None:
    """tbb and safe need Intel TBB's library, which numba loads only at its first parallel
    kernel: missing, it raised there, mid-run."""
    if os.environ.get("NUMBA_THREADING_LAYER") not in ("tbb", "safe"):
        return
    try:
        import numba.np.ufunc.tbbpool  # noqa: F401
    except (ImportError, OSError):
        raise EnvironmentSettingError(
            "NUMBA_THREADING_LAYER",
            os.environ["NUMBA_THREADING_LAYER"],
            "needs Intel TBB (pip install tbb), which this environment lacks; unset it "
            "(recscale's workqueue) or use omp",
        ) from None


check_numba_environment()
try:
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:  # an explicit user choice wins
        numba.config.THREADING_LAYER = "workqueue"
    HAVE_NUMBA = True
    _check_tbb()
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None
    HAVE_NUMBA = False

__all__ = ["HAVE_NUMBA", "numba"]
