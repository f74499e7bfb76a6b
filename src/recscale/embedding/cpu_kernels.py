"""Fused CPU backward for the table-batched embedding (native C, or numba).

One pass per step replaces the reference path's per-id gradient tensor, sort-based
``unique``, ``index_add`` and optimizer index ops::

    for each segment s in parallel:             # a segment = the ids of one feature
        merge duplicate rows with an open-addressing hash map,
        summing grad_pooled[bag_of_id[n]] * psw[n] per unique row
        apply the optimizer to each unique row in place

Contract: no row appears in two segments (true for table-batched storage, where
each feature owns its table's row block), so segments never race.
Results equal the reference path up to float summation order (tests). The same
pass exists in C (``recscale/native/sparse_update.c``, AVX2, with prefetching instead
of the touch pass); :func:`fused_update_cpu` uses it when it is built and the row
width is a multiple of 8, and the numba kernel otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from recscale import native
from recscale.embedding.optimizers import (
    ADAM_KIND,
    ROWWISE_ADAGRAD_KIND,
    SGD_KIND,
    SparseAdam,
    SparseOptimizer,
    SparseRowwiseAdagrad,
    SparseSGD,
    fused_params,
)
from recscale.kernels import HAVE_NUMBA
from recscale.kernels import numba as nb

_SGD, _ADAGRAD, _ADAM = SGD_KIND, ROWWISE_ADAGRAD_KIND, ADAM_KIND

if HAVE_NUMBA:

    @nb.njit(parallel=True, cache=True, nogil=True)
    def _fused_update(
        kind,
        weight,
        state1,
        state2,
        rows,
        seg_starts,
        bag_of_id,
        psw,
        has_psw,
        grad_pooled,
        lr,
        eps,
        beta1,
        beta2,
        step_size,
        dirty,
        track_dirty,
    ):
        num_seg = seg_starts.shape[0] - 1
        dim = weight.shape[1]
        touched = np.zeros(num_seg, np.float32)  # keeps the touch loads from being optimised away
        for s in nb.prange(num_seg):
            lo = seg_starts[s]
            n = seg_starts[s + 1] - lo
            if n == 0:
                continue
            cap = 16
            while cap < 2 * n:
                cap *= 2
            mask = cap - 1
            keys = np.full(cap, -1, np.int64)
            slot_of_key = np.empty(cap, np.int64)
            uniq = np.empty(n, np.int64)
            acc = np.zeros((n, dim), np.float32)
            u = 0
            for k in range(n):
                r = rows[lo + k]
                h = (r * 2654435761) & mask
                while keys[h] != -1 and keys[h] != r:
                    h = (h + 1) & mask
                if keys[h] == -1:
                    keys[h] = r
                    slot_of_key[h] = u
                    uniq[u] = r
                    u += 1
                j = slot_of_key[h]
                bag = bag_of_id[lo + k]
                w = psw[lo + k] if has_psw else np.float32(1.0)
                for d in range(dim):
                    acc[j, d] += grad_pooled[bag, d] * w
            # Touch pass: independent loads of every row (and its state) let the CPU
            # overlap the cache misses; the update pass below then hits the cache.
            # (config A, 53k random rows of a 1.7 GB table: 3.7 ms -> 1.6 ms)
            touch = np.float32(0.0)
            for j in range(u):
                r = uniq[j]
                touch += weight[r, 0] + state1[min(r, state1.shape[0] - 1), 0]
            touched[s] = touch
            for j in range(u):
                r = uniq[j]
                if track_dirty:  # rows changed since the last checkpoint (incremental checkpoints)
                    dirty[r] = 1
                if kind == 0:  # SGD
                    for d in range(dim):
                        weight[r, d] -= lr * acc[j, d]
                elif kind == 1:  # row-wise Adagrad
                    sq = np.float32(0.0)
                    for d in range(dim):
                        sq += acc[j, d] * acc[j, d]
                    state1[r, 0] += sq / dim  # adagrad state is passed as [R, 1]
                    scale = lr / (np.sqrt(state1[r, 0]) + eps)
                    for d in range(dim):
                        weight[r, d] -= scale * acc[j, d]
                else:  # lazy Adam
                    for d in range(dim):
                        g = acc[j, d]
                        m = beta1 * state1[r, d] + (1.0 - beta1) * g
                        v = beta2 * state2[r, d] + (1.0 - beta2) * g * g
                        state1[r, d] = m
                        state2[r, d] = v
                        weight[r, d] -= step_size * m / (np.sqrt(v) + eps)
        return touched.sum()


def numba_supports(weight: torch.Tensor, optimizer: SparseOptimizer) -> bool:
    return (
        HAVE_NUMBA
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and isinstance(optimizer, (SparseSGD, SparseRowwiseAdagrad, SparseAdam))
    )


def fused_update_cpu(
    optimizer: SparseOptimizer,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    segments: torch.Tensor,
    bag_of_id: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    grad_pooled: torch.Tensor,
    step: int,
    dirty: torch.Tensor | None = None,
    allow_native: bool = True,
    low: torch.Tensor | None = None,
) -> None:
    """In-place optimizer step on ``weight``/``state`` from the pooled gradient (see module
    doc); ``allow_native=False`` forces the numba kernel. fp16/bf16 ``weight`` (stored
    rows of ``embedding.row_precision``; stochastic rounding keyed by ``step``): native
    only; with ``low`` (int16, the values' low halves: split_bf16 rows) the update is
    exact fp32 and rounds nothing."""
    fp = fused_params(optimizer, step)
    kind, lr, eps, b1, b2, step_size = fp.kind, fp.lr, fp.eps, fp.beta1, fp.beta2, fp.step_size
    if (
        allow_native
        and weight.is_contiguous()
        and native.applies(weight, weight.shape[1], rows=True)
    ):
        _native_update(
            kind,
            weight,
            state,
            rows,
            segments,
            bag_of_id,
            per_sample_weights,
            grad_pooled,
            lr,
            eps,
            b1,
            b2,
            step_size,
            dirty,
            step,
            low,
        )
        return
    if weight.dtype != torch.float32:
        raise ValueError(
            f"the fused CPU update of {weight.dtype} rows needs the native kernels "
            f"({native.status()})"
        )
    grad_pooled = grad_pooled.float()  # a bf16 gradient (a bf16 consumer's): the C pass widens it
    empty = np.zeros((1, 1), np.float32)
    s1, s2 = ([state[n].numpy() for n in fp.state_names] + [empty, empty])[:2]
    # The kernel is typed once for 2-D state: row-wise Adagrad's [R] accumulator goes in as [R, 1].
    s1_arg = s1.reshape(-1, 1) if s1.ndim == 1 else s1
    psw = per_sample_weights.numpy() if per_sample_weights is not None else np.zeros(1, np.float32)
    _fused_update(
        kind,
        weight.numpy(),
        s1_arg,
        s2,
        rows.numpy(),
        segments.contiguous().numpy(),
        bag_of_id.numpy(),
        psw,
        per_sample_weights is not None,
        grad_pooled.contiguous().numpy(),
        np.float32(lr),
        np.float32(eps),
        np.float32(b1),
        np.float32(b2),
        np.float32(step_size),
        dirty.view(torch.uint8).numpy() if dirty is not None else np.zeros(1, np.uint8),
        dirty is not None,
    )


def _native_update(
    kind,
    weight,
    state,
    rows,
    segments,
    bag_of_id,
    psw,
    grad,
    lr,
    eps,
    b1,
    b2,
    step_size,
    dirty,
    step,
    low=None,
) -> None:
    lib = native.library()
    names = {_SGD: (), _ADAGRAD: ("sum",), _ADAM: ("exp_avg", "exp_avg_sq")}[
        kind
    ]  # FusedParams order
    states = [state[n] for n in names] + [None, None]
    rows, bag_of_id = rows.to(torch.int64).contiguous(), bag_of_id.to(torch.int64).contiguous()
    seg = segments.to(torch.int64).contiguous()
    grad = grad.contiguous() if grad.dtype in (torch.float32, torch.bfloat16) else grad.float()
    psw = psw.to(torch.float32).contiguous() if psw is not None else None
    ptr = [t.data_ptr() if t is not None else None for t in (states[0], states[1])]
    args = (
        kind,
        weight.data_ptr(),
        weight.shape[1],
        ptr[0],
        ptr[1],
        rows.data_ptr(),
        seg.data_ptr(),
    )
    tail = (
        bag_of_id.data_ptr(),
        psw.data_ptr() if psw is not None else None,
        grad.data_ptr(),
        grad.stride(0),
        lr,
        eps,
        b1,
        b2,
        step_size,
        dirty.view(torch.uint8).data_ptr() if dirty is not None else None,
        native.ROW_SPLIT if low is not None else native.ROW_FORMATS[weight.dtype],
        step,
        low.data_ptr() if low is not None else None,
        int(grad.dtype == torch.bfloat16),
    )
    # Split the segments over threads by id count (multi-hot features differ in length):
    # a part's share of the ids [lo, hi) takes the segments that start in it.
    starts = seg.numpy()
    num_seg = starts.shape[0] - 1
    total = int(starts[-1] - starts[0])

    def segment_at(i: int) -> int:  # the first segment starting at or after id i
        return num_seg if i >= total else int(np.searchsorted(starts, starts[0] + i))

    def part(_p: int, lo: int, hi: int) -> tuple:  # ids [lo, hi)
        return (*args, segment_at(lo), segment_at(hi), *tail)

    threads = max(1, min(torch.get_num_threads(), num_seg))
    for rc in native.parallel_call(lib, "recscale_sparse_update", max(total, 1), part, threads):
        if rc != 0:
            raise RuntimeError(f"native sparse update failed (code {rc})")


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uniq, inverse)`` of a CPU int64 tensor: its distinct values and each element's
    index among them (``uniq[inverse] == ids``), like ``torch.unique(..., return_inverse=
    True)`` but in order of first appearance, not sorted - by the native hash pass when
    it is built (0.8 ms against torch's sort's 2.4 for 53k ids on one core), else torch's."""
    lib = native.library()
    if (
        lib is None
        or ids.dtype != torch.int64
        or ids.device.type != "cpu"
        or ids.numel() >= 2**31 - 1
    ):
        return torch.unique(ids, return_inverse=True)
    ids = ids.contiguous()
    uniq = torch.empty_like(ids)
    inverse = torch.empty_like(ids)
    n = lib.recscale_unique_ids(ids.data_ptr(), ids.numel(), uniq.data_ptr(), inverse.data_ptr())
    if n < 0:
        raise MemoryError("unique_ids: no memory for the hash table")
    return uniq[:n], inverse.view(ids.shape)
