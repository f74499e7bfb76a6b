"""Which GEMM library runs a dense layer's products on a CPU: oneDNN or MKL.

torch's CPU wheels carry both. On this project's AMD EPYC (2 threads, fp32) oneDNN's
fused linear (``mkldnn._linear_pointwise``: ``x @ w^T`` with the bias and a ReLU, or an
added tensor, applied while the output block is in registers) is 10-25% faster than
MKL for the forward and input-gradient products of the MLPs and the DCNv2 cross layers
(``x [M, K] @ w^T`` with M = the batch), while MKL stays faster for the weight
gradient (``g^T x``, K = the batch). So the hand-written backward nodes call
:func:`linear` for the first kind and :func:`weight_grad` for the second: on a CPU with
AVX-512 our own kernel (``native/weight_grad.c``: 8-11% faster than MKL at config A's
large layers, 1.3-2x at its narrow ones, the bias gradient summed on the way), else
``torch.mm``. Anything other than fp32 CPU tensors (CUDA, bf16) goes to torch's own ops.
"""

from __future__ import annotations

import torch

from recscale import native


def _onednn_ops():
    """oneDNN's fused linear ops (plain, binary), or Nones without a oneDNN build."""
    if not torch.backends.mkldnn.is_available():
        return None, None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        return op.default, op.binary
    except (AttributeError, RuntimeError):
        return None, None


ONEDNN_LINEAR, ONEDNN_LINEAR_ADD = _onednn_ops()
# Tests switch these off to hold the MKL paths to the references too.
USE_ONEDNN = True
USE_NATIVE_WGRAD = True
# Fewer outputs than one 6-row tile of the kernel (the logit layer): MKL's GEMV is faster.
_WGRAD_MIN_OUT = 6
_WGRAD_TILE = 6  # rows of dw per register tile (MR in native/weight_grad.c)
# Less work than this (multiply-adds, ~10 us) is not worth waking a second thread.
_WGRAD_MIN_MACS = 1 << 20


def use_onednn(x: torch.Tensor) -> bool:
    return (
        USE_ONEDNN
        and ONEDNN_LINEAR is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
    )


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w^T`` (``w`` is ``[out, in]``, any strides) ``+ bias``, then ReLU, or
    ``+ add`` (a ``[M, out]`` tensor; not with bias or relu). A new tensor."""
    if use_onednn(x) and w.shape[0] > 1:  # N = 1 (a logit): a GEMV, torch's is as fast
        if add is not None:
            return ONEDNN_LINEAR_ADD(x, add, w, None, "add")
        return ONEDNN_LINEAR(x, w, bias, "relu" if relu else "none", [], "")
    if add is not None:
        return torch.addmm(add, x, w.t())
    out = torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    return out.relu_() if relu else out


def _native_wgrad_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        USE_NATIVE_WGRAD
        and g.device.type == "cpu"
        and g.dtype == torch.float32
        and x.dtype == torch.float32
        and g.dim() == 2
        and x.dim() == 2
        and g.shape[0] == x.shape[0]
        and g.shape[1] >= _WGRAD_MIN_OUT
        and g.stride(1) == 1
        and x.stride(1) == 1
        and native.has_avx512()
    )


def weight_grad(
    g: torch.Tensor, x: torch.Tensor, bias_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense layer's weight gradient ``g^T x`` (``g [B, out]`` the output gradient,
    ``x [B, in]`` the input; ``[out, in]``, contiguous) and, with ``bias_grad``, the bias
    gradient ``g.sum(0)``.

    The native kernel reads ``g`` and ``x`` in place (rows of samples, any row stride);
    the intra-op threads split the outputs."""
    if not _native_wgrad_applies(g, x):
        # a narrow input (13 -> 512: 0.83 -> 0.45 ms): MKL is much faster at x^T g
        if x.shape[1] <= 32 and x.shape[1] * 4 <= g.shape[1]:
            dw = torch.mm(x.t(), g).t().contiguous()
        else:
            dw = torch.mm(g.t(), x)
        return dw, (g.sum(0) if bias_grad else None)
    lib = native.library()
    batch, out, inp = g.shape[0], g.shape[1], x.shape[1]
    dw = torch.empty(out, inp)
    db = torch.empty(out) if bias_grad else None
    # threads take whole 6-row tiles of dw (no partial sums to add up: at 1024 -> 1024 a
    # batch split costs 7% more), if the work is worth a thread
    tiles = -(-out // _WGRAD_TILE)
    parts = min(torch.get_num_threads(), tiles) if batch * out * inp >= _WGRAD_MIN_MACS else 1
    bounds = [min(out, _WGRAD_TILE * (tiles * p // parts)) for p in range(parts + 1)]
    failed: list[int] = []

    def run(lo: int, hi: int) -> None:
        for p in range(lo, hi):
            o0, o1 = bounds[p], bounds[p + 1]
            rc = lib.recscale_weight_grad(
                g.data_ptr() + 4 * o0, g.stride(0), x.data_ptr(), x.stride(0),
                dw.data_ptr() + 4 * o0 * inp, inp,
                db.data_ptr() + 4 * o0 if db is not None else None, o1 - o0, inp, 0, batch,
            )  # fmt: skip
            if rc:
                failed.append(p)

    native.parallel_for(parts, run, parts)
    if failed:  # no memory for the packed blocks: torch's GEMM instead
        return torch.mm(g.t(), x), (g.sum(0) if bias_grad else None)
    return dw, db
