"""Reads and writes of a cached tier's rows by id, past the cache (a part of
:class:`~recscale.embedding.cached_storage.CachedStorage`, kept apart for size): what
checkpoints, evaluation and resharding use - each sees a row's newest value, from the
cache where it is resident, else from the slow tier.

The mixin works on the cache's own fields (``rows``, ``slot_of_row``, ``cache_weight``,
``cache_state``, ``cache_dirty``, ``_state_cols``, ``_lock``) and its ``_pack`` /
``_write_back``; ``CachedStorage``'s docstring draws them.
"""

from __future__ import annotations

import numpy as np
import torch


class CachedRowAccess:
    """``flush``, ``read_rows``, ``read_state``, ``write_rows``, ``write_state``."""

    def flush(self) -> None:
        """Write every dirty cached row back to the file."""
        with self._settled():
            self._write_back(torch.nonzero(self.cache_dirty).squeeze(1))
            self.rows.flush()

    def _gather(self, rows: torch.Tensor) -> np.ndarray:
        """Current ``[len(rows), D + S]`` values, from the cache where resident."""
        slots = self.slot_of_row[rows].long()
        out = self.rows.read(rows.numpy())  # a fresh array: overlaid below
        hit = slots >= 0
        if bool(hit.any()):
            out[hit.numpy()] = self._pack(slots[hit])
        return out

    def read_rows(self, rows):
        with self._settled():
            return torch.from_numpy(self._gather(rows.cpu())[:, : self.dim].copy())

    def read_state(self, rows):
        with self._settled():
            data = torch.from_numpy(self._gather(rows.cpu()))
            return {
                name: data[:, lo:hi].reshape(-1, *shape).clone()
                for name, shape, lo, hi in self._state_cols
            }

    @torch.no_grad()
    def write_rows(self, rows, values):
        with self._settled():
            rows = rows.cpu()
            self.rows.write_columns(rows.numpy(), 0, self.dim, values.float().cpu().numpy())
            slots = self.slot_of_row[rows].long()
            hit = slots >= 0
            self.cache_weight[slots[hit].to(self.device)] = values.float().to(self.device)[
                hit.to(self.device)
            ]

    @torch.no_grad()
    def write_state(self, rows, state):
        with self._settled():
            rows = rows.cpu()
            slots = self.slot_of_row[rows].long()
            hit = slots >= 0
            for name, _shape, lo, hi in self._state_cols:
                v = state[name].float().cpu()
                self.rows.write_columns(rows.numpy(), lo, hi, v.reshape(-1, hi - lo).numpy())
                self.cache_state[name][slots[hit].to(self.device)] = v.to(self.device)[
                    hit.to(self.device)
                ]
