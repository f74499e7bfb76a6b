"""Triton kernels for the GPU embedding path: the table-batched pooled lookup, and the
fused backward that merges duplicate ids and applies the sparse optimizer to the
touched rows only (no dense table gradient, as FBGEMM's TBE does on GPUs).

Optional (``pip install -e '.[gpu]'``); the torch-ops path is the fallback and the
reference they are tested against. Under ``TRITON_INTERPRET=1`` the same kernels run
on CPU tensors, which is how CI tests them without a GPU. Written for Triton >= 3.6
(what ships beside torch 2.11 on the GPU machines we measure on).

Lookup, ``BLOCK_B`` bags x ``BLOCK_D`` columns per program::

    rows [N] (global storage rows), offsets [num_bags + 1], psw [N] (optional)
    out[bag, :] = sum_{i in [offsets[bag], offsets[bag+1])} psw[i] * weight[rows[i], :]

Backward, ``BLOCK_U`` distinct rows per program. The host sorts the ids by row
(``torch.sort``, stable) and cuts the sorted list into one segment per distinct row::

    unique [U]      distinct rows, ascending
    seg    [U + 1]  segment u holds sorted positions [seg[u], seg[u+1])
    order  [N]      sorted position -> original id index
    g_u = sum over the segment of grad_pooled[bag_of_id[i], :] * psw[i]   (registers)
    then SGD / row-wise Adagrad / Adam on weight[unique[u]] and its state, in place.

Every distinct row is owned by one program, so updates never race. A program walks its
rows' segments one id at a time (three dependent loads an id), so it takes as long as
its longest segment: a hot row with 20k ids in a batch (a 3-row table at batch 65536, a
Zipf head) kept one program busy for ~30 ms on an H200 while the rest of the GPU idled.
Where some segment is longer than ``LIGHT`` ids (the host checks), those "heavy"
segments are summed first, in parallel, by ``_piece_sum_kernel`` (``SUB`` ids loaded at
once and reduced as a tile), in pieces of ``W`` ids counted from the row's own first id,
so that a row's sum depends on its ids alone, not on where other rows put them in the
sorted list (cache slots vs table rows, a shard's local rows: the same bits). A piece is
found from the block of ``LIGHT + 1`` sorted positions its first id falls in, with no
per-row bookkeeping: a block holds at most two piece starts::

    piece 2b       the one starting in block b [b * (LIGHT + 1), (b + 1) * (LIGHT + 1))
                   of the row owning the block's first position (W > LIGHT + 1: one)
    piece 2b + 1   the first piece of a heavy row starting inside block b (after its
                   first position; it owns the block's last position: it is > LIGHT long)
    partial [2 * NBLK, D]   heavy row u's g = its pieces k = 0, 1, ... in order, piece k
                            starting at seg[u] + k * W

The order of every sum is fixed by the row's ids (in their batch order: the sort is
stable) and the tile shapes, so the result is the same on every run (bitwise resume).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LIGHT = 32  # segments up to this many ids are summed id by id by their owning program
W = 256  # ids a piece of a heavy row


@triton.jit(do_not_specialize=["num_rows"])
def _pooled_lookup_kernel(
    weight_ptr,
    rows_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    num_bags,
    D,
    num_rows,
    HAS_PSW: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = bags < num_bags
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    start = tl.load(offsets_ptr + bags, mask=bmask, other=0)
    length = tl.load(offsets_ptr + bags + 1, mask=bmask, other=0) - start
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(length, axis=0)):
        valid = j < length
        row = tl.load(rows_ptr + start + j, mask=valid, other=0)
        # The 2-D mask is derived from ``length`` again, not from ``valid``: Triton 3.6's
        # layout pass fails ("mask type matches ptr type") when one 1-D mask feeds both a
        # 1-D load and a vectorized 2-D load (weight and D divisible by 16). A row outside
        # the table reads as zeros, never memory past it (the wrapper's doc).
        inside = (row >= 0) & (row < num_rows)
        m2 = (j < length[:, None]) & inside[:, None] & cmask[None, :]
        v = tl.load(weight_ptr + row[:, None] * D + cols[None, :], mask=m2, other=0.0)
        if HAS_PSW:
            v = v * tl.load(psw_ptr + start + j, mask=valid, other=0.0)[:, None]
        acc += v
    out = out_ptr + bags.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out, acc, mask=bmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["U"])
def _fused_update_kernel(
    weight_ptr,
    s1_ptr,
    s2_ptr,
    unique_ptr,
    seg_ptr,
    order_ptr,
    bag_ptr,
    psw_ptr,
    grad_ptr,
    dirty_ptr,
    partial_ptr,
    U,
    D,
    lr,
    eps,
    b1,
    b2,
    step_size,
    OPT: tl.constexpr,
    HAS_PSW: tl.constexpr,
    HAS_DIRTY: tl.constexpr,
    HEAVY: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LIGHT: tl.constexpr,
    W: tl.constexpr,
):
    us = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    umask = us < U
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    lo = tl.load(seg_ptr + us, mask=umask, other=0)
    count = tl.load(seg_ptr + us + 1, mask=umask, other=0) - lo
    if HEAVY:
        heavy = count > LIGHT
        serial = tl.where(heavy, 0, count)
    else:  # the host found no segment over LIGHT ids
        serial = count
    g = tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(serial, axis=0)):
        valid = j < serial
        idx = tl.load(order_ptr + lo + j, mask=valid, other=0)
        bag = tl.load(bag_ptr + idx, mask=valid, other=0)
        m2 = (j < serial[:, None]) & cmask[None, :]  # not from ``valid``: see the lookup
        gv = tl.load(grad_ptr + bag[:, None] * D + cols[None, :], mask=m2, other=0.0)
        if HAS_PSW:
            gv = gv * tl.load(psw_ptr + idx, mask=valid, other=0.0)[:, None]
        g += gv
    if HEAVY:  # a heavy row: its pieces in order (module doc)
        pieces = tl.where(heavy, (count + W - 1) // W, 0)
        first = 2 * (lo // (LIGHT + 1)) + (lo % (LIGHT + 1) != 0)  # piece 0's slot
        for k in range(0, tl.max(pieces, axis=0)):
            slot = tl.where(k == 0, first, 2 * ((lo + k * W) // (LIGHT + 1)))
            mk = (k < pieces[:, None]) & cmask[None, :]
            g += tl.load(partial_ptr + slot[:, None] * D + cols[None, :], mask=mk, other=0.0)
    row = tl.load(unique_ptr + us, mask=umask, other=0)
    m2 = umask[:, None] & cmask[None, :]
    w_ptrs = weight_ptr + row[:, None] * D + cols[None, :]
    w = tl.load(w_ptrs, mask=m2, other=0.0)
    if OPT == 0:  # optimizers.SGD_KIND
        w = w - lr * g
    elif OPT == 1:  # ROWWISE_ADAGRAD_KIND
        acc = tl.load(s1_ptr + row, mask=umask, other=0.0) + tl.sum(g * g, axis=1) / D
        tl.store(s1_ptr + row, acc, mask=umask)
        w = w - (lr / (tl.sqrt(acc) + eps))[:, None] * g
    else:  # ADAM_KIND
        m_ptrs = s1_ptr + row[:, None] * D + cols[None, :]
        v_ptrs = s2_ptr + row[:, None] * D + cols[None, :]
        m = tl.load(m_ptrs, mask=m2, other=0.0) * b1 + (1.0 - b1) * g
        v = tl.load(v_ptrs, mask=m2, other=0.0) * b2 + (1.0 - b2) * g * g
        tl.store(m_ptrs, m, mask=m2)
        tl.store(v_ptrs, v, mask=m2)
        w = w - step_size * m / (tl.sqrt(v) + eps)
    tl.store(w_ptrs, w, mask=m2)
    if HAS_DIRTY:
        tl.store(dirty_ptr + row, tl.full([BLOCK_U], 1, tl.uint8), mask=umask)


@triton.jit(do_not_specialize=["N"])
def _piece_sum_kernel(
    seg_ptr,
    inverse_ptr,
    order_ptr,
    bag_ptr,
    psw_ptr,
    grad_ptr,
    partial_ptr,
    N,
    D,
    HAS_PSW: tl.constexpr,
    LIGHT: tl.constexpr,
    W: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """partial[p] = the gradient summed over piece p (module doc); a slot with no piece
    is left unwritten."""
    p = tl.program_id(0)
    b0 = p // 2 * (LIGHT + 1)  # the block's first position
    inner = p % 2 == 1
    # the row to look at: the owner of the block's first position, or of its last (a
    # heavy row starting inside the block reaches past it)
    probe = tl.where(inner, tl.minimum(b0 + LIGHT, N - 1), b0)
    u = tl.load(inverse_ptr + probe)
    lo = tl.load(seg_ptr + u)
    hi = tl.load(seg_ptr + u + 1)
    # piece 2b: the row's first piece start at or after b0; piece 2b + 1: the row's start
    start = tl.where(inner, lo, lo + (b0 - lo + W - 1) // W * W)
    live = (hi - lo > LIGHT) & tl.where(inner, lo > b0, (start < b0 + LIGHT + 1) & (start < hi))
    stop = tl.where(live, tl.minimum(start + W, hi), start)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, stop - start, SUB):  # no iteration where there is no piece
        pos = start + s + tl.arange(0, SUB)
        valid = pos < stop
        idx = tl.load(order_ptr + pos, mask=valid, other=0)
        bag = tl.load(bag_ptr + idx, mask=valid, other=0)
        m2 = ((start + s + tl.arange(0, SUB))[:, None] < stop) & cmask[None, :]
        gv = tl.load(grad_ptr + bag[:, None] * D + cols[None, :], mask=m2, other=0.0)
        if HAS_PSW:
            gv = gv * tl.load(psw_ptr + idx, mask=valid, other=0.0)[:, None]
        acc += tl.sum(gv, axis=0)
    out = cols < tl.where(live, D, 0)  # not ``cmask & live``: a scalar mask operand
    tl.store(partial_ptr + p.to(tl.int64) * D + cols, acc, mask=out)


def _blocks(dim: int, budget: int = 4096) -> tuple[int, int]:
    """(rows per program, padded dim): about ``budget`` elements of registers a program."""
    block_d = triton.next_power_of_2(dim)
    return max(1, min(64, budget // block_d)), block_d


def _sub(block_d: int, budget: int = 4096) -> int:
    """Ids of a piece loaded at once: a [SUB, BLOCK_D] tile of about ``budget`` elements."""
    return max(1, min(W, budget // block_d))


def _check_rows(first: int, last: int, num_rows: int) -> None:
    """Raise IndexError where the smallest or largest row is outside ``[0, num_rows)``."""
    for row in (first, last):
        if not 0 <= row < num_rows:
            raise IndexError(f"row {row} is outside the table's {num_rows} rows")


def pooled_lookup(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    check_rows: bool = True,
) -> torch.Tensor:
    """Sum-pooled ``[len(offsets) - 1, D]`` (``F.embedding_bag(mode="sum",
    include_last_offset=True)`` semantics; empty bags give zeros).

    The kernel never reads outside ``weight``: a row outside it adds zeros. To say so,
    ``check_rows`` reads the rows' extremes (one device sync) and raises IndexError
    before the launch; a lookup that :func:`fused_update` follows leaves it to the
    update, which reads them at a sync it makes anyway and raises before any write."""
    num_bags, dim = offsets.shape[0] - 1, weight.shape[1]
    out = torch.empty(num_bags, dim, device=weight.device, dtype=torch.float32)
    if check_rows and rows.numel():
        _check_rows(*torch.stack(torch.aminmax(rows)).tolist(), weight.shape[0])
    if num_bags == 0:
        return out
    block_b, block_d = _blocks(dim)
    psw = per_sample_weights
    _pooled_lookup_kernel[(triton.cdiv(num_bags, block_b),)](
        weight,
        rows.contiguous(),
        offsets.contiguous(),
        psw.contiguous() if psw is not None else rows,
        out,
        num_bags,
        dim,
        weight.shape[0],
        HAS_PSW=psw is not None,
        BLOCK_B=block_b,
        BLOCK_D=block_d,
    )
    return out


def fused_update(
    optimizer,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    bag_of_id: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    grad_pooled: torch.Tensor,
    step: int,
    dirty: torch.Tensor | None = None,
) -> None:
    """The fused embedding backward on ``weight`` / ``state`` (see the module doc);
    ``step`` is the optimizer's step count for Adam's bias correction. Marks the touched
    rows in ``dirty`` (bool ``[rows]``) when given. Raises IndexError, having written
    nothing, where a row is outside ``weight``."""
    from recscale.embedding.optimizers import fused_params

    n, dim = rows.shape[0], weight.shape[1]
    if n == 0:
        return
    sorted_rows, order = torch.sort(rows, stable=True)  # a fixed summation order: bitwise resume
    unique, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    # one read (after the sync unique_consecutive makes): the rows' bounds, the longest run
    first, last, most = torch.stack((sorted_rows[0], sorted_rows[-1], counts.max())).tolist()
    _check_rows(first, last, weight.shape[0])
    u = unique.shape[0]
    seg = torch.zeros(u + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, 0, out=seg[1:])
    heavy = n - u >= LIGHT and most > LIGHT  # pieces only where a row has over LIGHT ids
    fp = fused_params(optimizer, step)
    s1, s2 = ([state[n] for n in fp.state_names] + [weight, weight])[:2]  # unused: any pointer
    block_u, block_d = _blocks(dim)
    psw = rows if per_sample_weights is None else per_sample_weights.contiguous()  # rows: unused
    bag_of_id, grad_pooled = bag_of_id.contiguous(), grad_pooled.contiguous()
    partial = weight  # an unused pointer unless there are pieces
    if heavy:
        # the distinct row of each sorted position, which the pieces look up
        inverse = torch.repeat_interleave(
            torch.arange(u, device=rows.device), counts, output_size=n
        )
        pieces = 2 * triton.cdiv(n, LIGHT + 1)
        partial = torch.empty(pieces, dim, device=weight.device, dtype=torch.float32)
        _piece_sum_kernel[(pieces,)](
            seg,
            inverse,
            order,
            bag_of_id,
            psw,
            grad_pooled,
            partial,
            n,
            dim,
            HAS_PSW=per_sample_weights is not None,
            LIGHT=LIGHT,
            W=W,
            SUB=_sub(block_d),
            BLOCK_D=block_d,
        )
    _fused_update_kernel[(triton.cdiv(u, block_u),)](
        weight,
        s1,
        s2,
        unique,
        seg,
        order,
        bag_of_id,
        psw,
        grad_pooled,
        dirty.view(torch.uint8) if dirty is not None else rows,
        partial,
        u,
        dim,
        fp.lr,
        fp.eps,
        fp.beta1,
        fp.beta2,
        fp.step_size,
        OPT=fp.kind,
        HAS_PSW=per_sample_weights is not None,
        HAS_DIRTY=dirty is not None,
        HEAVY=heavy,
        BLOCK_U=block_u,
        BLOCK_D=block_d,
        LIGHT=LIGHT,
        W=W,
    )
