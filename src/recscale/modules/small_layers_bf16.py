"""The bf16 node's small layers in one native pass each (``native/small_layers_bf16.c``,
AVX512-BF16): a logit layer's backward and a narrow first layer's weight gradient.

Why: on an AMX CPU torch's paths for them take 0.35 ms (the logit's outer product,
ReLU mask and GEMV) and 0.40 ms (the 13 -> 512 layer's bf16 GEMM and sum) of config A's
bf16 step on 2 vCPUs, and their bf16 GEMMs round the master weights' gradients to bf16;
here each is one pass and the gradients come out in fp32, as the other layers' do.
"""

from __future__ import annotations

import torch

from recscale import native
from recscale.modules import gemm

LOGIT_BLOCK = 64  # samples a partial sum of the logit's dw (small_layers_bf16.c)
USE = True  # False: torch's paths (tests; benchmarks/step_ab.py --switch small_bf16)
_MIN_PARALLEL = 1 << 20  # multiply-adds below which one thread runs a call


def available() -> bool:
    """Whether the kernels run here: the library loaded on a CPU with AVX512-BF16."""
    return USE and bool(native.cpu_features() & native.CPU_AVX512_BF16)


def logit_applies(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`logit_backward` runs for ``h [B, n] -> [B, 1]``, weight ``w [1, n]``."""
    return (
        available()
        and w.dim() == 2
        and w.shape[0] == 1
        and w.is_contiguous()
        and gemm.bf16_cpu_rows(h, h)
        and gemm.bf16_cpu_rows(w, w)
        and h.shape[1] == w.shape[1]
    )


def logit_backward(
    h: torch.Tensor, w: torch.Tensor, dz: torch.Tensor, mask: bool, input_grad: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dh [B, n] bf16 or None, dw [1, n] fp32, db [1] fp32)`` of a logit layer ``z = h
    w^T + b`` from ``dz [B, 1]`` (bf16): ``dh = dz * w`` as torch rounds a bf16 product,
    zero where ``h <= 0`` when ``mask`` (``h`` a ReLU output, as threshold_backward
    masks); ``dw`` and ``db`` summed in fp32 in blocks of 64 samples, then the blocks in
    order (the same bits on any number of threads)."""
    lib = native.library()
    batch, n = h.shape
    dz = dz.reshape(batch).to(torch.bfloat16).contiguous()
    blocks = -(-batch // LOGIT_BLOCK)
    dwp, dbp = torch.empty(blocks, n), torch.empty(blocks)
    dh = torch.empty(batch, n, dtype=torch.bfloat16) if input_grad else None
    if batch == 0:
        return dh, torch.zeros(1, n), torch.zeros(1)
    h_ptr, w_ptr, dz_ptr = h.data_ptr(), w.data_ptr(), dz.data_ptr()
    dwp_ptr, dbp_ptr = dwp.data_ptr(), dbp.data_ptr()
    dh_ptr = dh.data_ptr() if dh is not None else None

    def args(_p: int, lo: int, hi: int) -> tuple:  # blocks of samples [lo, hi)
        return (h_ptr, h.stride(0), w_ptr, dz_ptr, dwp_ptr, dbp_ptr, dh_ptr, n, batch, n,
                int(mask), lo, hi)  # fmt: skip

    threads = torch.get_num_threads() if batch * n >= _MIN_PARALLEL >> 2 else 1
    key = ("logit_bf16", batch, n)
    if any(native.parallel_call(lib, "recscale_logit_backward_bf16", blocks, args, threads, key)):
        raise RuntimeError("recscale_logit_backward_bf16 declined on a CPU that has AVX512-BF16")
    return dh, dwp.sum(0, keepdim=True), dbp.sum(0, keepdim=True)


def narrow_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`narrow_weight_grad` runs for a layer ``x [B, in] -> g [B, out]``:
    bf16 rows of a narrow input (``gemm.narrow_layer``)."""
    return available() and gemm.bf16_cpu_rows(g, x) and gemm.narrow_layer(g, x)


def narrow_weight_grad(
    g: torch.Tensor, x: torch.Tensor, bias_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g^T x [out, in], g.sum(0) [out] or None)`` in fp32 in one pass over ``g``: each
    output summed by one thread in sample order, pairs of samples at a time (vdpbf16ps:
    the same bits on any number of threads)."""
    lib = native.library()
    batch, out = g.shape
    n_in = x.shape[1]
    dw = torch.empty(out, n_in)
    db = torch.empty(out) if bias_grad else None
    if batch == 0:
        return dw.zero_(), (db.zero_() if db is not None else None)
    g_ptr, x_ptr, dw_ptr = g.data_ptr(), x.data_ptr(), dw.data_ptr()
    db_ptr = db.data_ptr() if db is not None else None

    def args(_p: int, lo: int, hi: int) -> tuple:  # blocks of 32 outputs [lo, hi)
        return (g_ptr, g.stride(0), x_ptr, x.stride(0), dw_ptr, db_ptr, out, n_in, batch, lo, hi)

    threads = torch.get_num_threads() if batch * out * n_in >= _MIN_PARALLEL else 1
    key = ("narrow_bf16", batch, out, n_in)
    tiles = -(-out // 32)
    if any(native.parallel_call(lib, "recscale_narrow_wgrad_bf16", tiles, args, threads, key)):
        raise RuntimeError("recscale_narrow_wgrad_bf16 declined on a CPU that has AVX512-BF16")
    return dw, db
