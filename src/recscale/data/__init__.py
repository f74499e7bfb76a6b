"""Batches and where they come from."""

from recscale.data.batch import Batch
from recscale.data.prefetch import Prefetcher
from recscale.data.synthetic import SyntheticCriteo

__all__ = ["Batch", "Prefetcher", "SyntheticCriteo"]
