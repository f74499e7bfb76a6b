"""The fused embedding lookup whose backward *is* the optimizer step.

Forward: one ``storage.lookup`` over every id of every table in the group
(``rows`` are already global row indices into the group's storage).

Backward (never builds a dense ``[num_rows, dim]`` gradient) hands the pooled
gradient to ``storage.apply_pooled_gradients``, which in the reference path does::

    grad_pooled [num_bags, D]
      -> per-id grad  [N, D]   = grad_pooled[bag_of_id] * per_sample_weight
      -> merge duplicates: unique rows [U], summed grads [U, D]
      -> storage.apply_gradients(unique_rows, summed)        (in place)

and on CPU runs as one fused numba pass (embedding/cpu_kernels.py).

Autograd only calls a backward for a function with an input that requires grad, so
callers pass a zero-size ``placeholder`` parameter; it receives no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recscale import native
from recscale.embedding.storage import RowStorage


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, placeholder, storage, rows, offsets, bag_of_id, segments, psw, pooled, explain
    ):
        """``pooled``: already computed (the native lookup), else ``storage.lookup``."""
        ctx.storage, ctx.explain = storage, explain
        ctx.save_for_backward(rows, bag_of_id, segments, psw)
        if pooled is not None:
            return pooled
        return storage.lookup(rows, offsets, psw, for_update=True)

    @staticmethod
    def backward(ctx, grad_pooled):
        rows, bag_of_id, segments, psw = ctx.saved_tensors
        if grad_pooled.dtype != torch.float32 and not ctx.storage.takes_bf16_gradients():
            grad_pooled = grad_pooled.float()  # a bf16 pooled output's gradient
        # A storage with ``always_apply`` (a replica that all-reduces) joins every step.
        if rows.numel() > 0 or ctx.storage.always_apply:
            try:
                ctx.storage.apply_pooled_gradients(rows, segments, bag_of_id, psw, grad_pooled)
            except IndexError as e:  # a row outside the storage, left to the update to find
                if ctx.explain is not None:
                    ctx.explain(e)
                raise
        else:  # every backward is one optimizer step (Adam's bias correction counts them)
            ctx.storage.step.add_(1)
        return (None,) * 9


def pooled_lookup(
    storage: RowStorage,
    placeholder: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    bag_of_id: torch.Tensor,
    segments: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    pooled: torch.Tensor | None = None,
    explain: Callable[[Exception], None] | None = None,
) -> torch.Tensor:
    """Sum-pooled ``[num_bags, dim]``; in training, backward updates ``storage`` in place.
    ``pooled``: the result, already computed by :func:`native_pooled_lookup`.
    ``explain``: called with the IndexError of an update that met a row outside the
    storage (a lookup that reads no such row leaves finding it to the update: the Triton
    kernels), to raise a clearer error in its place.

    ``bag_of_id[n]`` is the bag of ``rows[n]`` (``repeat_interleave`` of bag lengths);
    ``segments`` are the value-index boundaries of the features (``offsets[::B]``).
    Mean pooling is sum pooling with ``per_sample_weights = 1 / bag length``.
    """
    if torch.is_grad_enabled() and placeholder.requires_grad:
        args = (rows, offsets, bag_of_id, segments, per_sample_weights, pooled, explain)
        return _FusedLookup.apply(placeholder, storage, *args)
    if pooled is not None:
        return pooled
    return storage.lookup(rows, offsets, per_sample_weights)


def native_pooled_lookup(
    table: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    row_offset: torch.Tensor,
    table_sizes: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    bf16_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | int:
    """Id checks, global rows, ``bag_of_id`` and the sum-pooled ``[B*F, D]`` (sample-major:
    row ``b*F + f``, and ``bag_of_id`` indexes those rows) in one C pass per feature
    (``native/embedding_lookup.c``, features split over threads), from feature-major
    jagged ``values``/``offsets``. Returns ``(pooled, rows, bag_of_id)``, or the index of
    the first id outside its table (the caller raises). ``bf16_out``: ``pooled`` in bf16,
    each fp32 sum rounded to nearest even (for a bf16 consumer: half the bytes)."""
    values = values.to(torch.int64).contiguous()
    rows = torch.empty(values.shape[0], dtype=torch.int64)
    bag_of_id = torch.empty(values.shape[0], dtype=torch.int64)
    # A table of no rows (a row-wise shard that got none) has no data pointer, so the
    # pass only checks ids: its bags are empty, their sums zeros.
    alloc = torch.zeros if table.numel() == 0 else torch.empty
    dtype = torch.bfloat16 if bf16_out else torch.float32
    pooled = alloc(row_offset.shape[0] * batch_size, table.shape[1], dtype=dtype)
    bad = _native_pass(
        table,
        values,
        offsets,
        batch_size,
        row_offset,
        table_sizes,
        per_sample_weights,
        pooled,
        rows,
        bag_of_id,
    )
    return bad if bad is not None else (pooled, rows, bag_of_id)


def native_rows(
    values: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    row_offset: torch.Tensor,
    table_sizes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | int:
    """:func:`native_pooled_lookup`'s ``(rows, bag_of_id)`` alone, nothing pooled (a
    cache's first pass: its slots are known once the rows are), or the index of the
    first id outside its table."""
    values = values.to(torch.int64).contiguous()
    rows = torch.empty(values.shape[0], dtype=torch.int64)
    bag_of_id = torch.empty(values.shape[0], dtype=torch.int64)
    bad = _native_pass(
        None, values, offsets, batch_size, row_offset, table_sizes, None, None, rows, bag_of_id
    )
    return bad if bad is not None else (rows, bag_of_id)


def native_pool_slots(
    table: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    num_features: int,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Sum-pooled ``[B*F, D]`` (sample-major, as :func:`native_pooled_lookup`) of the
    rows ``slot_ids`` (one per id, feature-major jagged by ``offsets``) of a cache's
    ``table``: the same pass with the slots for values, every feature's rows at 0."""
    n = slot_ids.shape[0]
    zeros = torch.zeros(num_features, dtype=torch.int64)
    size = torch.full((num_features,), table.shape[0], dtype=torch.int64)
    pooled = torch.empty(num_features * batch_size, table.shape[1])
    scratch = torch.empty(2 * n, dtype=torch.int64)  # rows / bag_of_id again: unused
    bad = _native_pass(
        table,
        slot_ids.contiguous(),
        offsets,
        batch_size,
        zeros,
        size,
        per_sample_weights,
        pooled,
        scratch[:n],
        scratch[n:],
    )
    if bad is not None:
        raise RuntimeError(f"a cache slot outside the cache ({int(slot_ids[bad])})")
    return pooled


def _native_pass(
    table, values, offsets, batch_size, row_offset, table_sizes, psw, pooled, rows, bag_of_id
) -> int | None:
    """``recscale_pooled_lookup`` over every feature (split over threads); ``table``
    None: rows and bag_of_id only. None, or the first bad id's index."""
    lib = native.library()
    num_f = row_offset.shape[0]
    offsets = offsets.to(torch.int64).contiguous()
    psw = psw.to(torch.float32).contiguous() if psw is not None else None
    head = (
        table.data_ptr() if table is not None else None,
        table.shape[1] if table is not None else 0,
        values.data_ptr(),
        offsets.data_ptr(),
        batch_size,
        num_f,
    )
    tail = (
        row_offset.data_ptr(),
        table_sizes.data_ptr(),
        psw.data_ptr() if psw is not None else None,
        pooled.data_ptr() if pooled is not None else None,
        rows.data_ptr(),
        bag_of_id.data_ptr(),
        native.ROW_FORMATS[table.dtype] if table is not None else 0,
        int(pooled is not None and pooled.dtype == torch.bfloat16),
    )

    def part(_p: int, f0: int, f1: int) -> tuple:
        return (*head, f0, f1, *tail)

    rcs = native.parallel_call(lib, "recscale_pooled_lookup", num_f, part, torch.get_num_threads())
    if -2 in rcs:
        raise RuntimeError("native pooled lookup: unsupported dim")
    bad = [rc for rc in rcs if rc >= 0]
    return min(bad) if bad else None
