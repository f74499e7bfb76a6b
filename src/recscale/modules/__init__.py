"""Single-device building blocks. Nothing here knows about sharding."""

from recscale.modules.embedding_bag_collection import (
    EmbeddingBagCollection,
    IdOutOfRangeError,
    TableSpec,
)
from recscale.modules.interaction import CatInteraction, DotInteraction
from recscale.modules.mlp import MLP

__all__ = [
    "CatInteraction",
    "DotInteraction",
    "EmbeddingBagCollection",
    "IdOutOfRangeError",
    "MLP",
    "TableSpec",
]
