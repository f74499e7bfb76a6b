"""recscale: fast training of deep learning recommendation models.

Layers (imports point down only)::

    cli/ -> train/ -> models/ -> modules/ -> embedding/ -> data/ -> config/
"""

import os

# torch's OpenMP workers spin after every parallel region by default; our numba
# kernels and the data thread then fight them for the cores (2-core config A:
# 39k -> 43k samples/s with passive waiting, and far less run-to-run spread).
# libgomp reads this when torch is first imported, so it is set here, before any
# submodule imports torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
