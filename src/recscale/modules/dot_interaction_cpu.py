"""Fused CPU dot interaction, forward and backward: native (C, AVX2) or numba.

For ``T [B, K, D]`` (row 0 the bottom-MLP output when there are dense features,
then the F pooled embeddings) the output row of sample b is::

    [ dense_b (D, only with dense features) | <T_bi, T_bj> for i < j (or i <= j) | 0 ... 0 ]
                                              pairs in triu_indices order          pad

Compared with ``bmm(T, T^T)`` + gather, this computes only the pairs (half the
FLOPs), and its backward accumulates ``grad_T[b,i] += g_ij T[b,j]`` directly instead
of zero-filling and scattering into a ``[B, K, K]`` matrix. The native kernels
(``recscale/native/dot_interaction.c``, used when built, on AVX2 CPUs and for dims
that are multiples of 8) compute the same thing 3-4x faster: the numba loops over
D = 16 stay scalar. For D >= 64 on AVX-512 CPUs the C entry points run 4 x 4 tiles of
rows instead (``native/dot_interaction_avx512.c``: config B's D = 128 forward 1.8x
faster), and without AVX-512 the forward runs 2 x 4 tiles of AVX2 rows (B's forward
4.12 -> 3.15 ms on 2 threads).
"""

from __future__ import annotations

import numpy as np
import torch

from recscale import native
from recscale.kernels import HAVE_NUMBA
from recscale.kernels import numba as nb

if HAVE_NUMBA:

    @nb.njit(parallel=True, cache=True, fastmath=True, nogil=True)
    def _forward(t, out, first, offset):
        b_total, k, d = t.shape
        for b in nb.prange(b_total):
            p = first
            for i in range(k):
                for j in range(i + offset, k):
                    s = np.float32(0.0)
                    for x in range(d):
                        s += t[b, i, x] * t[b, j, x]
                    out[b, p] = s
                    p += 1

    @nb.njit(parallel=True, cache=True, fastmath=True, nogil=True)
    def _backward(t, g, grad_t, first, offset):
        b_total, k, d = t.shape
        for b in nb.prange(b_total):
            for i in range(k):
                for x in range(d):
                    grad_t[b, i, x] = 0.0
            p = first
            for i in range(k):
                for j in range(i + offset, k):
                    gp = g[b, p]
                    p += 1
                    if gp == 0.0:
                        continue
                    for x in range(d):
                        grad_t[b, i, x] += gp * t[b, j, x]
                        grad_t[b, j, x] += gp * t[b, i, x]


class FusedDotInteraction(torch.autograd.Function):
    """``(dense [B,D] | None, emb [B,F*D]) -> [B, out_dim]``; see the module docstring."""

    @staticmethod
    def forward(ctx, dense, emb, num_features, dim, self_interaction, out_dim):
        b = emb.shape[0]
        emb_bfd = emb.reshape(b, num_features, dim)
        t = (
            torch.cat([dense.unsqueeze(1), emb_bfd], dim=1)
            if dense is not None
            else emb_bfd.contiguous()
        )
        first = dim if dense is not None else 0
        out = torch.empty(b, out_dim, dtype=emb.dtype)
        if dense is not None:
            out[:, :dim] = dense
        offset = 0 if self_interaction else 1
        k = t.shape[1]
        num_pairs = k * (k + 1) // 2 if self_interaction else k * (k - 1) // 2
        out[:, first + num_pairs :] = 0.0
        _forward(t.numpy(), out.numpy(), first, offset)
        ctx.save_for_backward(t)
        ctx.has_dense, ctx.first, ctx.offset = dense is not None, first, offset
        ctx.emb_shape = emb.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (t,) = ctx.saved_tensors
        g = grad_out.contiguous()
        grad_t = torch.empty_like(t)
        _backward(t.numpy(), g.numpy(), grad_t.numpy(), ctx.first, ctx.offset)
        if ctx.has_dense:
            grad_dense = grad_t[:, 0, :] + g[:, : ctx.first]
            grad_emb = grad_t[:, 1:, :].reshape(ctx.emb_shape)
        else:
            grad_dense, grad_emb = None, grad_t.reshape(ctx.emb_shape)
        return grad_dense, grad_emb, None, None, None, None


class NativeDotInteraction(torch.autograd.Function):
    """Same contract as :class:`FusedDotInteraction`, on the C kernels: no ``T`` copy
    (the kernels read ``dense`` and ``emb`` in place, ``emb`` with its own strides), the
    batch split over threads. ``emb`` is ``[B, F*D]`` or ``[B, F, D]`` with any strides
    (``pooled_by_feature``: sample-major from the native lookup, a feature-major view
    from the torch one); its gradient comes back with the same shape and strides, which
    the embedding backward takes without a copy.

    ``bf16_out`` (a bf16 top MLP next, on a CPU with AVX512-BF16: see
    :func:`bf16_edges_available`): the output row in bf16 - the fp32 sums rounded as
    torch casts them - and its gradient read in bf16 (``native/dot_interaction_bf16.c``),
    so neither side makes an fp32 copy of the row. ``dense`` and ``emb`` in bf16 (the
    native lookup's bf16 sums, see :func:`bf16_pooled_available`; ``bf16_out`` then too):
    the products in fp32 on them widened exactly, and their gradients written in bf16
    (as :func:`bf16_pooled_available` says)."""

    @staticmethod
    def forward(ctx, dense, emb, num_features, dim, self_interaction, out_dim, bf16_out=False):
        lib = native.library()
        b = emb.shape[0]
        emb3 = emb.view(b, num_features, dim) if emb.dim() == 2 else emb
        if emb3.stride(2) != 1:  # the kernels need each D-vector contiguous
            emb3 = emb3.contiguous()
        dense = dense.contiguous() if dense is not None else None
        has_dense = dense is not None
        k = num_features + int(has_dense)
        in_bf16 = emb.dtype == torch.bfloat16
        if emb.dtype not in (torch.float32, torch.bfloat16) or (
            has_dense and dense.dtype != emb.dtype
        ):
            raise ValueError(
                f"the native dot interaction takes fp32 or bf16 rows of one dtype, got "
                f"{emb.dtype} embeddings and {dense.dtype if has_dense else 'no'} dense rows"
            )
        if in_bf16 and not bf16_out:
            raise ValueError("bf16 pooled vectors need a bf16 output row")
        out = torch.empty(b, out_dim, dtype=torch.bfloat16 if bf16_out else emb.dtype)
        d_ptr = dense.data_ptr() if has_dense else 0
        args = (k, dim, int(has_dense), int(self_interaction), out_dim, dim, *emb3.stride()[:2])
        args = (*args, int(in_bf16)) if bf16_out else args

        def part(_p: int, lo: int, hi: int) -> tuple:
            return (d_ptr, emb3.data_ptr(), out.data_ptr(), lo, hi, *args)

        kernel = "recscale_dot_forward_bf16" if bf16_out else "recscale_dot_forward"
        _check(native.parallel_call(lib, kernel, b, part, torch.get_num_threads()))
        ctx.save_for_backward(dense, emb3)
        ctx.shape = (num_features, dim, self_interaction, out_dim, emb.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lib = native.library()
        dense, emb3 = ctx.saved_tensors
        num_features, dim, self_interaction, out_dim, emb_shape = ctx.shape
        has_dense = dense is not None
        b = emb3.shape[0]
        g = grad_out.contiguous()
        in_bf16 = emb3.dtype == torch.bfloat16  # T in bf16: its gradients too
        # a bf16 row's gradient comes in bf16 (read as it is); any other in fp32
        bf16 = in_bf16 or (g.dtype == torch.bfloat16 and bf16_edges_available())
        g = g.to(torch.bfloat16) if bf16 else g.float()
        kernel = "recscale_dot_backward_bf16" if bf16 else "recscale_dot_backward"
        grad_emb = torch.empty_like(emb3)  # keeps emb3's strides (a dense permutation)
        grad_dense = torch.empty_like(dense) if has_dense else None
        d_ptr = dense.data_ptr() if has_dense else 0
        gd_ptr = grad_dense.data_ptr() if has_dense else 0
        k = num_features + int(has_dense)
        strides = (*emb3.stride()[:2], *grad_emb.stride()[:2])
        args = (k, dim, int(has_dense), int(self_interaction), out_dim, dim, *strides)
        args = (*args, int(in_bf16)) if bf16 else args

        def part(_p: int, lo: int, hi: int) -> tuple:
            return (
                d_ptr,
                emb3.data_ptr(),
                g.data_ptr(),
                gd_ptr,
                grad_emb.data_ptr(),
                lo,
                hi,
                *args,
            )

        _check(native.parallel_call(lib, kernel, b, part, torch.get_num_threads()))
        return grad_dense, grad_emb.view(emb_shape), None, None, None, None, None


def _check(rcs: list[int]) -> None:
    for rc in rcs:
        if rc != 0:
            raise RuntimeError(f"native dot interaction kernel failed (code {rc})")


USE_BF16_EDGES = True  # False: an fp32 output row under bf16 (benchmarks/step_ab.py)
USE_BF16_POOLED = True  # False: fp32 pooled vectors into the bf16 edges (step_ab.py)


def bf16_edges_available() -> bool:
    """Whether :class:`NativeDotInteraction` can write its row in bf16 here (the library
    on a CPU with AVX512-BF16)."""
    return USE_BF16_EDGES and bool(native.cpu_features() & native.CPU_AVX512_BF16)


def bf16_pooled_available(dim: int, rows: int) -> bool:
    """Whether :class:`NativeDotInteraction` can take the pooled vectors (and the dense
    row) of ``dim`` in bf16 here, ``rows`` of them a sample (the features, and the dense
    row), and give their gradients in bf16: the bf16 edges and a kernel that reads bf16
    rows - the AVX-512 tiles (``dim`` a multiple of 16, at least 64) or the narrow ones
    (``dim`` 16 or 32, at most 32 rows); on an AMX CPU some of those shapes run on its
    tiles instead (:func:`amx_interaction`)."""
    kernel_reads = dim >= 64 or (dim in (16, 32) and rows <= 32)
    return USE_BF16_POOLED and dim % 16 == 0 and kernel_reads and bf16_edges_available()


def amx_interaction(dim: int, rows: int, self_interaction: bool) -> bool:
    """Whether bf16 pooled vectors of ``dim``, ``rows`` a sample, interact on AMX tiles
    here (``native/dot_interaction_amx.c``: ``dim`` 16 or a multiple of 32 up to 256, at
    most 32 rows, no self pairs, an AMX CPU) rather than on the AVX-512 kernels."""
    lib = native.library()
    return (
        lib is not None
        and bf16_pooled_available(dim, rows)
        and bool(lib.recscale_dot_amx_applies(rows, dim, int(self_interaction)))
    )


def supported(t: torch.Tensor) -> bool:
    return HAVE_NUMBA and t.device.type == "cpu" and t.dtype == torch.float32
