"""The traffic of an embedding that shards every table's rows over all ranks by id
modulo the world and hands every rank the global batch's ids (``System.exchange =
"partials"``: Intel's MLPerf v3.1 DLRMv2, ``ipex.patch``'s ``MergFreqEmbeddingBag``),
per rank a step::

    forward   each rank scans the global batch's ids; for every (sample, table) pair
              with at least one id it owns, it sums those rows into one partial row
              and sends it, with the pair's int64 index, to the sample's rank:
              B * sum_t (1 - (1 - 1/W) ** h_t) rows (h_t ids a sample in table t,
              spread evenly over the ranks by id modulo W)
    backward  each rank sends, for every id of its own B/W samples, the id's gradient
              row (summed over repeats, which this count takes as none: the forecast's
              update prices every id as distinct) with the int64 id to its owner:
              B/W * sum_t h_t rows

Rows travel at ``wire`` bytes a value (bf16 there); the part addressed to the rank
itself, 1/W of each, stays off the wire. Pure arithmetic, no torch.
"""

from __future__ import annotations

INDEX_BYTES = 8  # an int64 (sample, table) index or id beside each row


def partial_rows(global_batch: int, hotness: float, world_size: int) -> float:
    """Expected partial rows of one table a rank sends forward: the global batch's
    samples holding at least one of the table's ids the rank owns."""
    return global_batch * (1.0 - (1.0 - 1.0 / world_size) ** hotness)


def partials_exchange_bytes(
    global_batch: int, pooling: list[float], dims: list[int], world_size: int, wire: int
) -> tuple[float, float]:
    """(forward, backward) bytes a rank sends to the other ranks a step, for tables of
    ``pooling`` ids a sample and ``dims`` columns."""
    w = world_size
    row = [d * wire + INDEX_BYTES for d in dims]
    forward = sum(partial_rows(global_batch, h, w) * r for h, r in zip(pooling, row))
    backward = sum(global_batch / w * h * r for h, r in zip(pooling, row))
    off_rank = (w - 1) / w
    return forward * off_rank, backward * off_rank
