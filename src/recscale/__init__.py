"""recscale: fast training of deep learning recommendation models.

Packages are layered (imports point down only); the order is stated once, in
docs/architecture.md ("Layers"), and enforced by tests/test_import_layers.py.
"""

import os

# The variables this import set because the user had not (benchmarks/peers.py runs its
# peer without them: a TorchRec user's process has none of them).
ENV_DEFAULTS: dict[str, str] = {}


def _default(key: str, value: str) -> None:
    if key not in os.environ:
        os.environ[key] = ENV_DEFAULTS[key] = value


# torch's OpenMP workers spin after every parallel region by default; our numba
# kernels and the data thread then fight them for the cores (2-core config A:
# 39k -> 43k samples/s with passive waiting, and far less run-to-run spread).
# libgomp reads this when torch is first imported, so it is set here, before any
# submodule imports torch; a value the user set wins.
_default("OMP_WAIT_POLICY", "PASSIVE")
# ... except for a short spin (libgomp: GOMP_SPINCOUNT wins over the policy): our native
# kernels run their parts on torch's OpenMP team (native/team.py), so nothing else wants
# the worker's core mid-step, and a worker that sleeps between a step's ops is woken ~30
# times a step at ~50 us each on a VM. Set only where that team exists (the native
# library is built and enabled): numba's threads would fight a spinning worker.
if os.environ.get("RECSCALE_NATIVE", "1") != "0" and os.environ.get("RECSCALE_TEAM", "1") != "0":
    # native._find's test, spelled out: that module imports torch, which must not load yet
    _here = os.path.join(os.path.dirname(__file__), "native")
    if any(f.startswith("_kernels") for f in os.listdir(_here)):
        _default("GOMP_SPINCOUNT", "20000")
# Back large torch allocations (the embedding tables) with transparent huge pages:
# random row gathers from a 13 GB table miss the TLB on nearly every row with 4 KiB
# pages (config B: gather 4 -> 8 GB/s, lookup + sparse update 22 -> 16 ms per step).
_default("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
