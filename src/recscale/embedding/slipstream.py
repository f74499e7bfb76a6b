"""Slipstream (Maboud, Adnan, Mahajan, Nair, 2024): skip the updates of hot embedding
rows that have stopped moving. A tier's pinned hot rows are watched; every
``interval`` updates their weights are compared with the last snapshot, and each that
was updated in the interval yet moved by less than ``threshold`` (relative L2:
||w - w_snap|| / ||w_snap||) is stale for the next interval - its ids are dropped from
the fused update, so the row is neither updated nor marked dirty (no write-back). A stale row trains
again the interval after, and is measured anew (a row is skipped at most every other
interval). Off by default: it changes the arithmetic (``embedding.slipstream``).

Layout: ``hot`` [H] cache slots watched; ``snapshot`` [H, dim] their weights on the
compute device; ``stale`` and ``touched`` [C] bool per cache slot, on the host.
"""

from __future__ import annotations

import torch


class Slipstream:
    def __init__(
        self,
        hot: torch.Tensor,
        cache_weight: torch.Tensor,
        cache_rows: int,
        threshold: float,
        interval: int,
    ) -> None:
        if not threshold >= 0.0 or interval < 1:
            raise ValueError(
                f"slipstream: threshold >= 0 and interval >= 1, got {threshold}, {interval}"
            )
        self.hot = hot.cpu()
        self.threshold, self.interval = float(threshold), int(interval)
        self.snapshot = cache_weight[self.hot.to(cache_weight.device)].clone()
        self.stale = torch.zeros(cache_rows, dtype=torch.bool)
        # updated since the last snapshot: a row no batch touched did not move because it
        # was not trained, not because it has converged - it is never judged stale
        self.touched = torch.zeros(cache_rows, dtype=torch.bool)

    def homes(self):
        """Its tensors as ``RowStorage.homes`` lists them: the snapshot beside the cache
        on the compute device, the per-slot flags on the host."""
        yield "slipstream.snapshot", self.snapshot, True
        yield "slipstream.stale", self.stale, False
        yield "slipstream.touched", self.touched, False

    def skip(self, stats, rows, slots, segments, bag_of_id, per_sample_weights):
        """A batch's update without the ids of stale slots: ``rows``/``slots`` [N] per
        id (host), ``segments`` [F+1] value-index boundaries (recounted), ``bag_of_id``
        and ``per_sample_weights`` [N] (on the compute device). Counts into ``stats``
        the ids whose update was due and those skipped."""
        keep = ~self.stale[slots]
        stats.id_updates += slots.numel()
        self.touched[slots] = True  # (a stale row is not judged at the next snapshot)
        if bool(keep.all()):
            return rows, slots, segments, bag_of_id, per_sample_weights
        stats.skipped += slots.numel() - int(keep.sum())
        kept = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(keep, 0)])
        k = keep.to(bag_of_id.device)
        return (
            rows[keep],
            slots[keep],
            kept[segments.cpu().long()].to(segments.device, segments.dtype),
            bag_of_id[k],
            per_sample_weights[k] if per_sample_weights is not None else None,
        )

    def after_update(self, step: int, cache_weight: torch.Tensor) -> None:
        """Every ``interval`` steps: mark the watched rows that moved less than the
        threshold stale (those stale until now train again), and take a new snapshot."""
        if step % self.interval or not self.hot.numel():
            return
        w = cache_weight[self.hot.to(cache_weight.device)]
        moved = (w - self.snapshot).norm(dim=1) / self.snapshot.norm(dim=1).clamp_min(1e-12)
        was, trained = self.stale[self.hot], self.touched[self.hot]
        self.stale[self.hot] = (moved.cpu() < self.threshold) & trained & ~was
        self.touched.zero_()
        self.snapshot = w.clone()
