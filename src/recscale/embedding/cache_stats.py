"""The ssd/host tier's counters and small records (``cached_storage.py``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch


class CacheTooSmallError(RuntimeError):
    """One batch (plus the pinned ones) needs more distinct rows than the cache holds."""


@dataclass
class CacheStats:
    lookups: int = 0  # distinct rows requested per batch (by its prefetch, else its lookup)
    hits: int = 0  # ... already resident when first requested
    prefetched: int = 0  # misses fetched by prefetch, ahead of their lookup (no stall)
    bytes_read: int = 0  # from the slow tier
    bytes_written: int = 0  # write-backs to the slow tier
    evictions: int = 0
    id_updates: int = 0  # ids whose row update was due (Slipstream on)
    skipped: int = 0  # ... of which Slipstream skipped as stale
    read_wait_seconds: float = 0.0  # lookups waiting for their batch's reads to land

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "prefetched": self.prefetched,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "evictions": self.evictions,
            "id_updates": self.id_updates,
            "skipped_updates": self.skipped,
            "read_wait_seconds": self.read_wait_seconds,
        }


@dataclass
class Prefetched:
    rows: torch.Tensor  # the batch's rows, to recognise its lookup
    slots: torch.Tensor  # its distinct rows' slots (pinned until the lookup)
    slot_ids: torch.Tensor | None  # per id (CPU int64): what the lookup pools
    device_slot_ids: torch.Tensor | None  # the same on the cache's device
    # reads still landing (CachedStorage._complete): the lookup waits for this future,
    # whose result is None or the error the reads met
    landing: Future | None = None


@dataclass
class UpdatePin:
    """A batch looked up for an update not yet applied: its slots stay resident."""

    rows: torch.Tensor  # the rows the lookup was given (the update gets the same tensor)
    slots: torch.Tensor  # its distinct rows' slots
    slot_ids: torch.Tensor  # per id (CPU int64): the update's slots, no second probe
