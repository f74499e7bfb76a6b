"""Which GEMM library runs a dense layer's products on a CPU: oneDNN or MKL.

torch's CPU wheels carry both. On this project's AMD EPYC (2 threads, fp32) oneDNN's
fused linear (``mkldnn._linear_pointwise``: ``x @ w^T`` with the bias and a ReLU, or an
added tensor, applied while the output block is in registers) is 10-25% faster than
MKL for the forward and input-gradient products of the MLPs and the DCNv2 cross layers
(``x [M, K] @ w^T`` with M = the batch), while MKL stays faster for the weight
gradient (``g^T x``, K = the batch). So the hand-written backward nodes call
:func:`linear` for the first kind and ``torch.mm`` for the second. Anything other than
fp32 CPU tensors (CUDA, bf16) goes to torch's own ops.
"""

from __future__ import annotations

import torch


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
# Tests switch this off to hold the MKL path to the references too.
USE_ONEDNN = True


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
