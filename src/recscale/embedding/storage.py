"""Where embedding rows live, behind one small interface.

A :class:`RowStorage` holds ``num_rows`` rows of width ``dim`` plus the fused
optimizer's per-row state. The lookup kernel only ever calls:

* ``lookup(rows, offsets, per_sample_weights)`` -> pooled ``[num_bags, dim]``
* ``apply_pooled_gradients(rows, segments, bag_of_id, psw, grad_pooled)``
                                                 -> the whole fused backward; the base
  class runs the reference path (per-id grads, merge duplicates, then
  ``apply_gradients``), a storage may override it with a fused kernel
* ``apply_gradients(unique_rows, grad)``        -> in-place optimizer step
* ``read_rows`` / ``write_rows``, ``read_state`` / ``write_state``
                                                 -> raw access (checkpoints, tests)

Abilities are declared, never probed: ``tier`` (device | host | ssd), ``always_apply``
(joins a collective every step, ids or not), ``prefetch`` / ``clear_prefetch`` /
``flush`` / ``cache_stats`` (no-ops / None unless a tier has a slow level), and
``track_dirty`` + ``dirty`` (rows updated since the last checkpoint).

:class:`DeviceStorage` keeps everything in one tensor on the compute device. Other
tiers (host memory under a GPU, SSD under a cache) implement the same interface,
so models never change with placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from recscale.embedding import kernels
from recscale.embedding.cpu_kernels import fused_update_cpu
from recscale.embedding.optimizers import SparseOptimizer

KERNELS = kernels.KERNELS


def merge_duplicate_rows(
    rows: torch.Tensor, grad: torch.Tensor, in_order: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated rows: ``rows [N], grad [N, D] -> unique [U], summed [U, D]``.
    ``in_order`` (default: off the CPU) adds each row's ids in their original order."""
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    if in_order if in_order is not None else grad.device.type != "cpu":
        # index_add_ on a GPU sums duplicates with atomics in no fixed order, so two runs
        # (a resumed one and an uninterrupted one) differ in the last bits. Sum each
        # row's ids in one bag instead: embedding_bag's forward adds a bag's entries in
        # order, one bag per thread block.
        order = torch.argsort(inverse, stable=True)
        offsets = torch.zeros(unique.shape[0] + 1, dtype=torch.int64, device=grad.device)
        torch.cumsum(torch.bincount(inverse, minlength=unique.shape[0]), 0, out=offsets[1:])
        summed = F.embedding_bag(order, grad, offsets, mode="sum", include_last_offset=True)
        return unique, summed
    summed = torch.zeros(unique.shape[0], grad.shape[1], dtype=grad.dtype, device=grad.device)
    summed.index_add_(0, inverse, grad)  # deterministic on the CPU
    return unique, summed


def pool_rows(
    dense: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None
) -> torch.Tensor:
    """Sum-pool already-gathered rows ``dense [N, D]`` (id n's row) into bags by
    ``offsets`` (``num_bags + 1``): storages that build their rows (decoded, composed)."""
    ids = torch.arange(dense.shape[0], device=dense.device)
    return F.embedding_bag(
        ids,
        dense,
        offsets,
        mode="sum",
        per_sample_weights=per_sample_weights,
        include_last_offset=True,
    )


def per_id_gradients(
    grad_pooled: torch.Tensor, bag_of_id: torch.Tensor, per_sample_weights: torch.Tensor | None
) -> torch.Tensor:
    """``[N, D]``: each id's gradient, its bag's gradient times its pooling weight."""
    grad_ids = grad_pooled.index_select(0, bag_of_id)
    if per_sample_weights is not None:
        grad_ids = grad_ids * per_sample_weights.unsqueeze(1)
    return grad_ids


class DevicePlacementError(RuntimeError):
    """A table's tensor is not on the device its plan puts it on (one line: the table,
    the tensor, where it is and where it belongs)."""


class RowStorage(nn.Module, ABC):
    num_rows: int
    dim: int
    tier: str = "device"  # where the rows live: device | host | ssd (config.schema.PLACEMENTS)
    always_apply: bool = False  # a replica whose update joins a collective every step
    derived_rows: bool = False  # rows computed from factors (compressed): no write_rows
    dirty: torch.Tensor | None = None  # [num_rows] bool while tracking (see track_dirty)

    def track_dirty(self, enabled: bool) -> None:
        """Keep a per-row flag of rows updated since the flags were last cleared
        (incremental checkpoints write only those rows)."""
        self.dirty = (
            torch.zeros(self.num_rows, dtype=torch.bool, device=self.device) if enabled else None
        )

    def prefetch(self, rows: torch.Tensor) -> None:
        """Make a coming batch's ``rows`` fast to reach (a tier with a cache); default: nothing."""

    def clear_prefetch(self) -> None:
        """Forget prefetched batches that will not be looked up; default: nothing."""

    def flush(self) -> None:
        """Write cached changes back to the slow tier (before a checkpoint); default: nothing."""

    def cache_stats(self):
        """Hit/miss counters of a cached tier (``CacheStats``), or None."""
        return None

    @abstractmethod
    def lookup(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        for_update: bool = False,
    ) -> torch.Tensor:
        """Sum-pool rows into bags: ``offsets`` has ``num_bags + 1`` entries (last == len(rows)).
        ``for_update``: the backward will update these rows (a cache keeps them resident)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the rows (or their cache, or factors) live; subclasses name the tensor."""

    def homes(self):
        """Every tensor of the storage as ``(name, tensor, on_compute)``: rows, caches,
        factors and their optimizer state belong on the compute device (True); the
        ``step`` count and CPU-side bookkeeping on the host (False). A tier adds the
        tensors it holds outside ``nn.Module``'s registry."""
        for name, t in self.named_parameters():
            yield name, t, True
        for name, t in self.named_buffers():
            yield name, t, name.rsplit(".", 1)[-1] != "step"

    def misplaced(self, compute: torch.device) -> list[str]:
        """``homes`` that are not where they belong when training runs on ``compute``."""
        out = []
        host = torch.device("cpu")
        for name, t, on_compute in self.homes():
            want = torch.device(compute) if on_compute else host
            same = t.device.type == want.type and (
                want.index is None or t.device.index in (None, want.index)
            )
            if not same:
                out.append(f"{name} is on {t.device}, belongs on {want}")
        return out

    def _apply(self, fn, recurse=True):
        # ``module.to(device)`` moves every buffer; the ``step`` count stays on the CPU,
        # where it is read every step (``int(self.step)``: Adam's bias correction) - on
        # a GPU that read would be a device sync per storage per step.
        step = self._buffers.get("step")
        out = super()._apply(fn, recurse)
        if step is not None and step.device.type == "cpu":
            self._buffers["step"] = step
        return out

    def native_slot_table(self) -> torch.Tensor | None:
        """A cache's ``[slots, dim]`` CPU table that ``recscale.native``'s lookup may pool
        from with the slots :meth:`slots_for_update` hands out, or None (the default).
        Only valid for storages whose backward is ``apply_pooled_gradients`` on the rows
        given to ``slots_for_update``."""
        return None

    def slots_for_update(self, rows: torch.Tensor) -> torch.Tensor:
        """Make a training batch's ``rows`` (one per id) resident in
        :meth:`native_slot_table` until their update, as ``lookup(..., for_update=True)``
        does, and return each id's slot (CPU int64). Here, for a storage that keeps its
        rows in place: a row is its own slot."""
        return rows.cpu()

    def native_lookup_table(self) -> torch.Tensor | None:
        """The ``[rows, dim]`` weight that ``recscale.native``'s fused lookup
        (``embedding_lookup.c``) may read and pool directly, or None (the default: the
        storage's own ``lookup`` runs). Only valid for storages whose backward is
        ``apply_pooled_gradients`` on those same rows."""
        return None

    def apply_pooled_gradients(
        self,
        rows: torch.Tensor,
        segments: torch.Tensor,
        bag_of_id: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        grad_pooled: torch.Tensor,
    ) -> None:
        """The fused backward: ``rows[n]`` was pooled into bag ``bag_of_id[n]`` with weight
        ``per_sample_weights[n]``; ``grad_pooled [num_bags, dim]`` is the loss gradient of the
        bags. ``segments`` (value-index boundaries, one segment per feature) partition the
        ids so that no row appears in two segments."""
        grad_ids = per_id_gradients(grad_pooled, bag_of_id, per_sample_weights)
        unique, summed = merge_duplicate_rows(rows, grad_ids)
        self.apply_gradients(unique, summed)

    def takes_bf16_gradients(self) -> bool:
        """Whether :meth:`apply_pooled_gradients` reads a bf16 ``grad_pooled`` as it is
        (else the caller widens it to fp32 first)."""
        return False

    @abstractmethod
    def apply_gradients(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on unique ``rows`` with their merged gradients ``[U, dim]``."""

    @abstractmethod
    def read_rows(self, rows: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None: ...

    @abstractmethod
    def read_state(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer state of ``rows``: name -> ``[len(rows), ...]``."""

    @abstractmethod
    def write_state(self, rows: torch.Tensor, state: dict[str, torch.Tensor]) -> None: ...


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
        kernel: str = "auto",
        weight_dtype: torch.dtype = torch.float32,  # LowPrecisionStorage stores fewer bits
    ):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.num_rows, self.dim, self.optimizer, self.kernel = num_rows, dim, optimizer, kernel
        self.register_buffer(
            "weight", torch.empty(num_rows, dim, dtype=weight_dtype, device=device)
        )
        # The step count stays on the CPU: read every step (Adam), never a device sync.
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.state_names = []
        for name, shape in optimizer.state_shapes(dim).items():
            t = torch.full((num_rows, *shape), optimizer.init_value(name), device=device)
            self.register_buffer(f"state_{name}", t)
            self.state_names.append(name)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"state_{name}") for name in self.state_names}

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def native_lookup_table(self) -> torch.Tensor | None:
        w = self.weight
        return (
            w
            if kernels.choose_once(self, self.kernel, "lookup", w, self.dim, 128) == "native"
            else None
        )

    def lookup(self, rows, offsets, per_sample_weights, for_update=False):
        if kernels.choose_once(self, self.kernel, "lookup", self.weight, self.dim) == "triton":
            from recscale.embedding import triton_kernels

            # a lookup for an update leaves checking its rows to the update (one sync less)
            return triton_kernels.pooled_lookup(
                self.weight, rows, offsets, per_sample_weights, check_rows=not for_update
            )
        return F.embedding_bag(
            rows,
            self.weight,
            offsets,
            mode="sum",
            per_sample_weights=per_sample_weights,
            include_last_offset=True,
        )

    def backward_kernel(self) -> str:
        """Which kernel runs the fused backward (see ``embedding/kernels.py``)."""
        return kernels.choose_once(self, self.kernel, "backward", self.weight, self.dim)

    def takes_bf16_gradients(self) -> bool:
        # the C update widens a bf16 gradient as it reads it (native/sparse_update.c)
        return self.backward_kernel() == "native"

    @torch.no_grad()
    def apply_pooled_gradients(self, rows, segments, bag_of_id, per_sample_weights, grad_pooled):
        kernel = self.backward_kernel()
        if kernel == "torch":
            if self.dirty is not None:
                self.dirty.index_fill_(0, rows, True)
            return super().apply_pooled_gradients(
                rows, segments, bag_of_id, per_sample_weights, grad_pooled
            )
        self.step.add_(1)
        if kernel == "triton":
            from recscale.embedding import triton_kernels

            triton_kernels.fused_update(
                self.optimizer,
                self.weight,
                self.optimizer_state(),
                rows,
                bag_of_id,
                per_sample_weights,
                grad_pooled,
                int(self.step),
                self.dirty,
            )
            return
        fused_update_cpu(
            self.optimizer,
            self.weight,
            self.optimizer_state(),
            rows,
            segments,
            bag_of_id,
            per_sample_weights,
            grad_pooled,
            int(self.step),
            self.dirty,
            allow_native=kernel == "native",
            low=self.low_halves(),
        )

    def low_halves(self) -> torch.Tensor | None:
        """Split rows' low 16 bits (``LowPrecisionStorage``, split_bf16), else None."""
        return None

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        self.step.add_(1)
        self.optimizer.update_(self.weight, self.optimizer_state(), rows, grad, int(self.step))

    def read_rows(self, rows):
        return self.weight.index_select(0, rows)

    @torch.no_grad()
    def write_rows(self, rows, values):
        self.weight.index_copy_(0, rows.to(self.weight.device), values.to(self.weight))

    def read_state(self, rows):
        return {name: t.index_select(0, rows) for name, t in self.optimizer_state().items()}

    @torch.no_grad()
    def write_state(self, rows, state):
        for name, t in self.optimizer_state().items():
            t.index_copy_(0, rows.to(t.device), state[name].to(t))
