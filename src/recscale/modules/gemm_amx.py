"""bf16 weight gradients on AMX tiles (``native/weight_grad_amx.c``): ``g^T x`` in fp32
and the bias gradient, for the MLPs' bf16 node on CPUs with AMX-BF16.

Two calls on the intra-op threads: the first packs ``g`` (transposed) and ``x`` into
1 KiB tiles (the threads split the tiles; the bias sums come with ``g``'s), the second
multiplies them (the threads split the outputs in pairs of 16-row tiles). Each result
is one thread's, summed in sample order: the same bits for any split.

On a 2-vCPU Intel Xeon VM with AMX (config B's 1024 -> 1024 over 2048 samples) oneDNN's
bf16 GEMM takes 2.9 ms and gives bf16, the AVX512-BF16 kernel 20.4 ms."""

from __future__ import annotations

import functools

import torch

from recscale import native

_TILE = 512  # bf16 elements in a packed 16 x 32 tile
# Weights below which the input gradient's packing of W runs on one thread: the pass is
# short (A's 256 x 512 ~30 us) and a second thread's hand-off costs more (in config A's
# bf16 step on 2 vCPUs the four packs took 0.36 ms a step on two threads, 0.18 on one;
# B's, up to 1024 x 1024, 0.72 against 0.63).
_PACK_MIN_PARALLEL = 1 << 21


@functools.lru_cache(maxsize=1)
def ready() -> bool:
    """Whether the kernel runs here: the library loaded, AMX-BF16, and Linux's grant of
    the tile state to this process (asked once: the weight gradients ask every layer)."""
    lib = native.library()
    return (
        lib is not None
        and bool(native.cpu_features() & native.CPU_AMX_BF16)
        and lib.recscale_amx_ready() == 1
    )


def weight_grad(
    g: torch.Tensor, x: torch.Tensor, bias_grad: bool, threads: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(g^T x [out, in], g.sum(0) or None)`` in fp32 for bf16 ``g [B, out]``, ``x [B,
    in]`` (rows contiguous, any row stride), or None when the kernel declined (no AMX
    grant): the caller then takes another path."""
    lib = native.library()
    batch, m = g.shape
    n = x.shape[1]
    if batch == 0:
        return torch.zeros(m, n), (torch.zeros(m) if bias_grad else None)
    # the kernel transposes its first operand into tiles: x, when it is the narrow one
    # (13 -> 512: x^T g, transposed back), else g
    swap = n * 4 <= m
    first, second = (x, g) if swap else (g, x)
    rows, cols = first.shape[1], second.shape[1]  # of the product the tiles compute
    steps = -(-batch // 32)
    mt, nt = 2 * -(-rows // 32), 2 * -(-cols // 32)  # tiles of 16, in pairs
    a = torch.empty(mt * steps * _TILE, dtype=torch.bfloat16)
    b = torch.empty(nt * steps * _TILE, dtype=torch.bfloat16)
    sums = torch.empty(16 * max(mt, nt)) if bias_grad else None
    c = torch.empty(rows, cols)
    s_ptr = sums.data_ptr() if sums is not None else None
    f_ptr, s2_ptr, a_ptr, b_ptr = first.data_ptr(), second.data_ptr(), a.data_ptr(), b.data_ptr()

    def pack(_p: int, lo: int, hi: int) -> tuple:  # pairs of tiles [lo, hi): A's, then B's
        return (
            f_ptr, first.stride(0), s2_ptr, second.stride(0), a_ptr, b_ptr, s_ptr, int(swap),
            rows, cols, batch, mt, lo, hi,
        )  # fmt: skip

    def multiply(_p: int, lo: int, hi: int) -> tuple:  # pairs of A's tile rows [lo, hi)
        return (a_ptr, b_ptr, c.data_ptr(), cols, rows, cols, batch, lo, hi)

    for kernel, n_items, args in (
        ("recscale_wgrad_amx_pack", (mt + nt) // 2, pack),
        ("recscale_wgrad_amx_gemm", mt // 2, multiply),
    ):
        if any(
            native.parallel_call(lib, kernel, n_items, args, threads, key=(kernel, m, n, batch))
        ):
            return None
    dw = c.t().contiguous() if swap else c
    return dw, (sums[:m] if sums is not None else None)


def input_grad(
    g: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor | None,
    out_dtype: torch.dtype,
    threads: int,
    bias_grad: bool = False,
    x: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """``(g [B, k] . w [k, n], g.sum(0) or None, g^T x or None)``: the product (bf16
    operands, rows contiguous, any row stride) zero where
    ``mask [B, n]`` (bf16; the ReLU output below the layer) is <= 0, as a fresh
    ``[B, n]`` tensor of ``out_dtype`` (bf16, rounded to nearest even, or fp32); with
    ``bias_grad`` the column sums of ``g`` in fp32 (each block of 32 samples summed in
    order, then the blocks: the same bits on any split); with ``x`` (bf16 ``[B, n]``,
    the layer's input: the mask's tensor where there is one) the layer's weight
    gradient ``g^T x [k, n]`` in fp32 - the pass packs ``g`` and ``x`` as the
    weight-gradient kernel's tiles, whose multiply then takes them: the same bits as
    :func:`weight_grad`. None when the kernel declined (no AMX grant)."""
    lib = native.library()
    batch, k = g.shape
    n = w.shape[1]
    out = torch.empty(batch, n, dtype=out_dtype)
    wgrad = x is not None
    if batch == 0:
        return out, (torch.zeros(k) if bias_grad else None), (torch.zeros(k, n) if wgrad else None)
    steps, nt, blocks = -(-k // 32), 2 * -(-n // 32), -(-batch // 32)
    wp = torch.empty(nt * steps * _TILE, dtype=torch.bfloat16)
    sums = torch.empty(blocks, k) if bias_grad else None
    # the weight gradient's tiles: g^T (2 ceil(k / 32) of them a step), x in pairs of samples
    wa = torch.empty(2 * steps * blocks * _TILE, dtype=torch.bfloat16) if wgrad else None
    wb = torch.empty(nt * blocks * _TILE, dtype=torch.bfloat16) if wgrad else None
    dw = torch.empty(k, n) if wgrad else None
    m_ptr, m_ld = (mask.data_ptr(), mask.stride(0)) if mask is not None else (None, 0)
    g_ptr, w_ptr, wp_ptr, o_ptr = g.data_ptr(), w.data_ptr(), wp.data_ptr(), out.data_ptr()
    s_ptr = sums.data_ptr() if sums is not None else None
    wa_ptr, wb_ptr = (wa.data_ptr(), wb.data_ptr()) if wa is not None else (None, None)
    x_ptr, x_ld = (x.data_ptr(), x.stride(0)) if x is not None else (None, 0)
    f32 = int(out_dtype == torch.float32)

    def pack(_p: int, lo: int, hi: int) -> tuple:  # pairs of W's column tiles [lo, hi)
        return (w_ptr, w.stride(0), k, n, wp_ptr, lo, hi)

    def multiply(_p: int, lo: int, hi: int) -> tuple:  # blocks of 32 samples [lo, hi)
        return (
            g_ptr, g.stride(0), wp_ptr, m_ptr, m_ld, o_ptr, n, f32, s_ptr, x_ptr, x_ld, wa_ptr,
            wb_ptr, batch, k, n, lo, hi,
        )  # fmt: skip

    def weights(_p: int, lo: int, hi: int) -> tuple:  # pairs of dw's tile rows [lo, hi)
        return (wa_ptr, wb_ptr, dw.data_ptr(), n, k, n, batch, lo, hi)

    calls = [
        ("recscale_igrad_amx_pack", nt // 2, pack, threads if k * n >= _PACK_MIN_PARALLEL else 1),
        ("recscale_igrad_amx", blocks, multiply, threads),
    ]
    if wgrad:
        calls.append(("recscale_wgrad_amx_gemm", steps, weights, threads))
    for kernel, n_items, args, parts in calls:
        if any(native.parallel_call(lib, kernel, n_items, args, parts, key=(kernel, k, n, batch))):
            return None
    return out, (sums.sum(0) if sums is not None else None), dw
