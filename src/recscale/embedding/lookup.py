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

import torch

from recscale.embedding.storage import RowStorage


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, storage, rows, offsets, bag_of_id, segments, per_sample_weights):
        ctx.storage = storage
        ctx.save_for_backward(rows, bag_of_id, segments, per_sample_weights)
        return storage.lookup(rows, offsets, per_sample_weights, for_update=True)

    @staticmethod
    def backward(ctx, grad_pooled):
        rows, bag_of_id, segments, psw = ctx.saved_tensors
        # A storage with ``always_apply`` (a replica that all-reduces) joins every step.
        if rows.numel() > 0 or getattr(ctx.storage, "always_apply", False):
            ctx.storage.apply_pooled_gradients(rows, segments, bag_of_id, psw, grad_pooled)
        return None, None, None, None, None, None, None


def pooled_lookup(
    storage: RowStorage,
    placeholder: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    bag_of_id: torch.Tensor,
    segments: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum-pooled ``[num_bags, dim]``; in training, backward updates ``storage`` in place.

    ``bag_of_id[n]`` is the bag of ``rows[n]`` (``repeat_interleave`` of bag lengths);
    ``segments`` are the value-index boundaries of the features (``offsets[::B]``).
    Mean pooling is sum pooling with ``per_sample_weights = 1 / bag length``.
    """
    if torch.is_grad_enabled() and placeholder.requires_grad:
        return _FusedLookup.apply(
            placeholder, storage, rows, offsets, bag_of_id, segments, per_sample_weights
        )
    return storage.lookup(rows, offsets, per_sample_weights)
