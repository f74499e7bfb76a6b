"""recscale: fast training of deep learning recommendation models.

Layers (imports point down only)::

    cli/ -> train/ -> models/ -> modules/ -> embedding/ -> data/ -> config/
"""

__version__ = "0.1.0"
