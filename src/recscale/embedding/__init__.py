"""Embedding storage, the fused lookup kernel and the fused sparse optimizers."""

from recscale.embedding.lookup import pooled_lookup
from recscale.embedding.optimizers import (
    SparseAdam,
    SparseOptimizer,
    SparseRowwiseAdagrad,
    SparseSGD,
    build_sparse_optimizer,
)
from recscale.embedding.storage import DeviceStorage, RowStorage, merge_duplicate_rows

__all__ = [
    "DeviceStorage",
    "RowStorage",
    "SparseAdam",
    "SparseOptimizer",
    "SparseRowwiseAdagrad",
    "SparseSGD",
    "build_sparse_optimizer",
    "merge_duplicate_rows",
    "pooled_lookup",
]
