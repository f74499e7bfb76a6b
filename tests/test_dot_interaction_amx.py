"""The bf16 dot interaction on AMX tiles (``native/dot_interaction_amx.c``): bf16 T (the
pooled vectors and the dense row), the row and T's gradients in bf16. Its fp32 sums of
exact bf16 products run in the tiles' order, not the AVX-512 kernels' (whose bits
tests/test_dot_interaction_bf16.py pins), so here each value is held to an fp64
reference: within one bf16 rounding of it plus an fp32 sum's error (relative to the
sum of the terms' magnitudes), the same bits on one thread and two. Skips on a CPU
without AMX."""

from __future__ import annotations

import ctypes

import pytest
import torch

from recscale import native
from recscale.modules import dot_interaction_cpu
from recscale.modules.dot_interaction_cpu import NativeDotInteraction
from recscale.modules.interaction import DotInteraction

BF16 = torch.bfloat16


def _needs_amx(dim: int, rows: int) -> None:
    if not dot_interaction_cpu.amx_interaction(dim, rows, False):
        pytest.skip(f"the AMX interaction does not run here: {native.status()}")


def _reference(dense, emb, g, has_dense):
    """fp64 row, T's gradient and their bounds (the sums of |terms|), by matmuls."""
    t = emb.double()
    if has_dense:
        t = torch.cat([dense.double()[:, None], t], 1)
    k, d = t.shape[1], t.shape[2]
    iu = torch.triu_indices(k, k, 1)
    pairs = (t @ t.transpose(1, 2))[:, iu[0], iu[1]]
    pairs_bound = (t.abs() @ t.abs().transpose(1, 2))[:, iu[0], iu[1]]
    lead = [dense.double()] if has_dense else []
    row = torch.cat([*lead, pairs], 1)
    row_bound = torch.cat([x.abs() for x in lead] + [pairs_bound], 1)
    gp = g.double()[:, d if has_dense else 0 :][:, : iu.shape[1]]
    coef = torch.zeros(t.shape[0], k, k, dtype=torch.float64)
    coef[:, iu[0], iu[1]] = gp
    coef = coef + coef.transpose(1, 2)
    grad_t, grad_bound = coef @ t, coef.abs() @ t.abs()
    if has_dense:  # the dense row's pass-through
        grad_t[:, 0] += g.double()[:, :d]
        grad_bound[:, 0] += g.double()[:, :d].abs()
    return row, row_bound, grad_t, grad_bound


def _close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    got = got.double()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    err = (got - want).abs()[~nan]
    tol = 2.0**-8 * want.abs()[~nan] + 1e-5 * bound[~nan]
    assert bool((err <= tol).all()), float((err - tol).max())


def _run(dense, emb, num_f, dim, out_dim, upstream, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        d = dense.clone().requires_grad_(True) if dense is not None else None
        e = emb.clone().requires_grad_(True)
        out = NativeDotInteraction.apply(d, e, num_f, dim, False, out_dim, True)
        out.backward(upstream)
    finally:
        torch.set_num_threads(before)
    return out.detach(), e.grad, d.grad if d is not None else None


# config B's (d 128, 26 features and the dense row) and A's (d 16, half a step of 32);
# 32 rows (two whole row tiles); 15 (one); 17 (one row past a tile); the widest d
@pytest.mark.parametrize(
    "dim,num_f,has_dense",
    [
        (128, 26, True),
        (16, 26, True),
        (32, 31, True),
        (16, 31, False),
        (64, 15, False),
        (96, 16, True),
        (256, 5, True),
    ],
)
@pytest.mark.parametrize("feature_major", [False, True])
def test_amx_row_and_gradients_hold_to_an_fp64_reference(dim, num_f, has_dense, feature_major):
    _needs_amx(dim, num_f + has_dense)
    b = 37
    gen = torch.Generator().manual_seed(dim + num_f)
    dense = torch.randn(b, dim, generator=gen).to(BF16) if has_dense else None
    emb = torch.randn(num_f, b, dim, generator=gen).to(BF16).transpose(0, 1)
    emb = emb if feature_major else emb.contiguous()
    emb[3, 1, 5] = float("nan")  # a NaN in one sample's row: NaN where fp64 has one
    inter = DotInteraction(num_f, dim, has_dense, False)
    upstream = torch.randn(b, inter.out_dim, generator=gen).to(BF16)
    out, grad_emb, grad_dense = _run(dense, emb, num_f, dim, inter.out_dim, upstream, 1)
    assert out.dtype == BF16 and grad_emb.dtype == BF16
    assert grad_emb.stride() == emb.stride()  # T's own layout
    row, row_bound, grad_t, grad_bound = _reference(dense, emb, upstream, has_dense)
    width = row.shape[1]
    _close(out[:, :width], row, row_bound)
    assert not out[:, width:].float().abs().sum()  # the padding columns are zeros
    e0 = int(has_dense)
    _close(grad_emb, grad_t[:, e0:], grad_bound[:, e0:])
    if has_dense:
        _close(grad_dense, grad_t[:, 0], grad_bound[:, 0])
    # each sample is one thread's: two threads give the same bits
    two = _run(dense, emb, num_f, dim, inter.out_dim, upstream, 2)
    for a, c in zip((out, grad_emb, grad_dense), two):
        if a is not None:
            assert torch.equal(a.view(torch.int16), c.view(torch.int16))


def test_shapes_the_tiles_do_not_take_stay_on_the_avx512_kernels():
    """Self pairs, more than 32 rows, a d other than 16 or a multiple of 32 up to 256,
    and the switch off: not on the tiles."""
    _needs_amx(128, 27)
    amx = dot_interaction_cpu.amx_interaction
    assert amx(128, 27, False) and amx(16, 27, False) and amx(32, 32, False)
    assert amx(256, 2, False)
    assert not amx(128, 27, True)
    assert not amx(128, 33, False) and not amx(16, 33, False)
    assert not amx(48, 27, False) and not amx(288, 27, False) and not amx(8, 27, False)
    flag = ctypes.c_int.in_dll(native.library(), "recscale_dot_amx")
    saved, flag.value = flag.value, 0
    try:
        assert not amx(128, 27, False)
    finally:
        flag.value = saved
