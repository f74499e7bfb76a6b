"""Where embedding rows live, behind one small interface.

A :class:`RowStorage` holds ``num_rows`` rows of width ``dim`` plus the fused
optimizer's per-row state. The lookup kernel only ever calls:

* ``lookup(rows, offsets, per_sample_weights)`` -> pooled ``[num_bags, dim]``
* ``apply_gradients(unique_rows, grad)``        -> in-place optimizer step
* ``read_rows`` / ``write_rows``                 -> raw access (checkpoints, tests)

:class:`DeviceStorage` keeps everything in one tensor on the compute device. Other
tiers (host memory under a GPU, SSD under a cache) implement the same interface,
so models never change with placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from recscale.embedding.optimizers import SparseOptimizer


class RowStorage(nn.Module, ABC):
    num_rows: int
    dim: int

    @abstractmethod
    def lookup(
        self, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Sum-pool rows into bags: ``offsets`` has ``num_bags + 1`` entries (last == len(rows))."""

    @abstractmethod
    def apply_gradients(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on unique ``rows`` with their merged gradients ``[U, dim]``."""

    @abstractmethod
    def read_rows(self, rows: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None: ...


class DeviceStorage(RowStorage):
    """All rows and optimizer state as tensors on one device (buffers, so ``.to()`` and
    ``state_dict()`` carry them; they are not ``nn.Parameter``s, so no dense optimizer
    or autograd ever sees them)."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        optimizer: SparseOptimizer,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.num_rows, self.dim, self.optimizer = num_rows, dim, optimizer
        self.register_buffer("weight", torch.empty(num_rows, dim, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.state_names = []
        for name, shape in optimizer.state_shapes(dim).items():
            t = torch.full((num_rows, *shape), optimizer.init_value(name), device=device)
            self.register_buffer(f"state_{name}", t)
            self.state_names.append(name)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"state_{name}") for name in self.state_names}

    def lookup(self, rows, offsets, per_sample_weights):
        return F.embedding_bag(
            rows,
            self.weight,
            offsets,
            mode="sum",
            per_sample_weights=per_sample_weights,
            include_last_offset=True,
        )

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        self.step += 1
        self.optimizer.update_(self.weight, self.optimizer_state(), rows, grad, int(self.step))

    def read_rows(self, rows):
        return self.weight.index_select(0, rows)

    @torch.no_grad()
    def write_rows(self, rows, values):
        self.weight.index_copy_(0, rows, values.to(self.weight.dtype))
