"""Which GEMM runs a dense layer's products on a CPU: oneDNN, MKL or our own kernels.

torch's CPU wheels carry oneDNN and MKL. MKL runs every fp32 product of the MLPs and
DCNv2 on an Intel CPU and on an x86 CPU without AVX-512 (``MKL_FIRST``: measured faster
there than all of what follows). Elsewhere - an AMD EPYC with AVX-512 (Zen 4), where
MKL ran 10-20% below oneDNN - oneDNN's fused linear
(``mkldnn._linear_pointwise``: ``x @ w^T`` with the bias and a ReLU, or an added
tensor, applied while the output block is in registers) is 10-25% faster than MKL for
the forward and input-gradient products of the MLPs and the DCNv2 cross layers (``x [M,
K] @ w^T`` with M = the batch): :func:`linear`, from ``ONEDNN_MIN_MACS`` (below it MKL:
oneDNN's cost a call outweighs its gain). The weight gradient (``g^T x``, K = the
batch, both operands sample-major) oneDNN runs fast only from a transposed copy of
``g``; :func:`weight_grad` runs it through our own kernel (``native/weight_grad.c``;
AVX-512: 6-11% faster than MKL at configs A and B's layers, 1.1-1.4x at the narrow
ones, level at DCNv2's widest; its AVX2 tiles, level with MKL isolated, run where
``MKL_FIRST`` is set off; the bias gradient summed on the way). A logit layer (``n ->
1``) has its own one-pass kernels (:func:`logit_forward`, :func:`logit_backward`), and a
narrow first layer (13 -> 512) its forward (:func:`narrow_forward`) and a weight
gradient that applies the layer's ReLU mask as it reads the gradient
(:func:`narrow_weight_grad`). bf16 weight gradients on a CPU with
AVX512-BF16 run ``native/weight_grad_bf16.c`` (fp32 results, the bias gradient on the
way: the MLPs' bf16 node) unless the CPU has AMX: there :func:`input_grad` runs
``native/input_grad_amx.c`` (the ReLU mask, the bias and the weight gradient's packing
in its one pass; :mod:`gemm_amx`), the other large layers' weight gradients
``native/weight_grad_amx.c`` (fp32 results) and small ones oneDNN's bf16 GEMM; anything
else other than fp32 CPU tensors (CUDA, bf16 elsewhere) goes to torch's own ops.
"""

from __future__ import annotations

import torch

from recscale import native
from recscale.modules import gemm_amx
from recscale.procfs import cpu_vendor, cpuinfo_field


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
USE_NATIVE_LOGIT = True
USE_NATIVE_NARROW_WGRAD = True  # the narrow first layer's kernels: weight gradient,
USE_NATIVE_NARROW_FORWARD = True  # forward
USE_FUSED_BF16 = True  # modules/mlp.py's bf16 node (off: autocast's modules)
# bf16 weight gradients on an AMX CPU: native/weight_grad_amx.c (off: oneDNN's GEMM)
USE_AMX_WGRAD = True
# bf16 input gradients on an AMX CPU, the ReLU mask applied as they are stored:
# native/input_grad_amx.c (off: oneDNN's GEMM, then threshold_backward)
USE_AMX_IGRAD = True
# ... and with them the layer's weight gradient: g and x packed as its tiles on the way
USE_AMX_FUSED_WGRAD = True
# The kernel runs for layers of more than one output (a logit's k = 1 pads to 32 in the
# tiles, and torch's outer product is as fast: 2048 samples, 256 inputs, with the weight
# gradient: 0.21 against 0.22 ms; 64 -> 16 0.095 against 0.054, 77 samples 40 -> 64
# 0.058 against 0.023) up to 2^19 weights (in config B's bf16 step, the input gradient
# alone, ours / torch's GEMM and mask: 256 -> 128 0.28 / 0.38 ms, 512 -> 256 0.57 / 0.76,
# 1024 -> 512 1.23 / 1.66, 480 -> 1024 1.12 / 1.09, 1024 -> 1024 2.74 / 2.22: its tile
# loop runs at ~35% of the tiles' peak; with the weight gradient's packing, 1024 -> 1024
# 7.3 against 3.5 + 3.5)
_AMX_IGRAD_MAX_WEIGHTS = 1 << 19
_BF16_KERNEL_ON_AMX = False  # tests: the AVX512-BF16 kernel on an AMX CPU as well
_NARROW_MAX_IN = 13  # NARROW_MAX_IN in native/narrow_layer.c
# Fewer outputs than one 6-row tile of the kernel (the logit layer): MKL's GEMV is faster.
_WGRAD_MIN_OUT = 6
_WGRAD_TILE = 6  # rows of dw per register tile (MR in native/weight_grad.c)
# Less work than this (multiply-adds; ~0.15 ms on one core) runs on one thread: handing
# half to a pool thread costs ~0.1 ms on a 2-core VM (64 -> 16: 0.18 ms on two threads,
# 0.09 on one).
_WGRAD_MIN_MACS = 1 << 24
_AMX_MIN_MACS = 1 << 26  # the same for the AMX kernel, ~4x faster a core
# Layers with fewer weights leave bf16 weight gradients to oneDNN on an AMX CPU: there
# its one pass matches or beats our two (pack, then multiply; on 2 threads at batch 2048,
# oneDNN / ours: 256 -> 512 0.97, 368 -> 512 1.01, 256 -> 1024 0.99, 512 -> 768 1.38,
# 480 -> 1024 1.55, 1024 -> 1024 1.44; 13 -> 512 0.79, a logit 0.53); at 2^17, with A's
# 368 -> 512 and 512 -> 256 on the kernel, A's bf16 step was level (12.70 against 12.78 ms)
_AMX_MIN_WEIGHTS = 1 << 18
_WGRAD_KC = 64  # samples per packed block (KC in native/weight_grad.c)
# Which of native/weight_grad.c's kernels runs: 0 the widest the CPU has (AVX-512, else
# AVX2), 1 AVX2, 2 AVX-512. Tests set 1 to reach the AVX2 kernel on AVX-512 CPUs.
_WGRAD_ISA = 0
# Threads split the samples instead of the outputs while the result is at most this
# large (each then packs only its own rows; the partial results cost an add): see
# _native_at_b_batch_split. Tests set it to 0 to force the output split.
_WGRAD_BATCH_SPLIT_BYTES = 1 << 20


# MKL is Intel's library and picks its kernels by vendor: on an AMD CPU it runs AVX2
# kernels tuned for Zen (``perf`` on the AVX2 EPYC: ``mkl_blas_def_sgemm_kernel_0_zen``).
# On an Intel CPU, and on a CPU without AVX-512 (where any library runs AVX2), MKL runs
# the MLPs' products (forward, input and weight gradients) and DCNv2's cross layers
# faster than oneDNN's fused linear and our weight-gradient kernel; those were chosen
# on an AMD EPYC with AVX-512 (Zen 4), where MKL ran 10-20% below oneDNN's AVX-512.
# `python benchmarks/step_ab.py --switch mkl_first --config C`, 2 threads, fp32 - host A
# (Xeon, AVX-512 + AMX), 2026-11-30, a slow hour:
# criteo_kaggle (batch 128) 8.54 -> 7.42 ms a step, MKL faster in 10 of 10 rounds;
# default (1024) 8.78 -> 8.37, 8 of 10; A (2048) 42.5 -> 41.1, 7 of 8; B 477 -> 450, 6
# of 10; the default model with DCNv2 (`--model.interaction=dcnv2`) 54.3 -> 50.2, 8 of
# 8. A weight gradient alone at 128 samples, 512 -> 256: MKL 125 us, the kernel 208.
# The AVX2 EPYC (Zen 3), 2026-12-07: criteo_kaggle 5.95 -> 5.47, 7 of 8; A 57.6 -> 52.5,
# 9 of 10; B 281 -> 255, 3 of 4; default with DCNv2 83.8 -> 75.5, 8 of 8; default level
# (11.51 -> 11.17, 3 of 6).
# Without MKL (torch on ARM) the routes below. Tests set it to reach them on any host.


def mkl_runs_first(vendor: str, flags: str, has_mkl: bool) -> bool:
    """Whether MKL runs the fp32 products on a CPU of this ``vendor`` (``vendor_id``) and
    ``flags`` (``/proc/cpuinfo``'s line) - the rule above."""
    return has_mkl and (vendor == "GenuineIntel" or "avx512f" not in flags.split())


MKL_FIRST = mkl_runs_first(cpu_vendor(), cpuinfo_field("flags"), torch.backends.mkl.is_available())
# Elsewhere, oneDNN's fused linear for products of this many multiply-adds up; MKL
# below, where oneDNN's cost a call outweighs its kernels (host A, M = 128: 64 -> 16 36
# us against MKL's 6, 256 -> 64 53 against 35; at M = 2048 64 -> 16 61 against 47, 256 ->
# 64 277 against 316). Tests set 0 to reach oneDNN with small operands.
ONEDNN_MIN_MACS = 1 << 22


def use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x @ w^T`` through oneDNN (see ``MKL_FIRST``)."""
    return (
        USE_ONEDNN
        and not MKL_FIRST
        and ONEDNN_LINEAR is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and w.shape[0] > 1  # N = 1 (a logit): a GEMV, torch's is as fast
        and x.shape[0] * x.shape[1] * w.shape[0] >= ONEDNN_MIN_MACS
    )


def fp32_route() -> str:
    """Which library runs the fp32 products of the MLPs on this CPU, in words."""
    if MKL_FIRST:
        return f"MKL ({'an Intel CPU' if cpu_vendor() == 'GenuineIntel' else 'no AVX-512'})"
    wgrad = " + native weight gradients" if USE_NATIVE_WGRAD and native.library() else ""
    if USE_ONEDNN and ONEDNN_LINEAR is not None:
        return f"oneDNN{wgrad}, MKL below {ONEDNN_MIN_MACS:,} multiply-adds"
    return f"MKL{wgrad}"


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w^T`` (``w`` is ``[out, in]``, any strides) ``+ bias``, then ReLU, or
    ``+ add`` (a ``[M, out]`` tensor; not with bias or relu). A new tensor."""
    if use_onednn(x, w):
        if add is not None:
            return ONEDNN_LINEAR_ADD(x, add, w, None, "add")
        return ONEDNN_LINEAR(x, w, bias, "relu" if relu else "none", [], "")
    if add is not None:
        return torch.addmm(add, x, w.t())
    out = torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    return out.relu_() if relu else out


def _fp32_cpu_rows(*ts: torch.Tensor) -> bool:
    """What the native kernels read: 2-D fp32 CPU tensors with contiguous rows."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1
        for t in ts
    )


def _native_wgrad_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        USE_NATIVE_WGRAD
        and not MKL_FIRST
        and _fp32_cpu_rows(g, x)
        and g.shape[0] == x.shape[0]
        and g.shape[1] >= _WGRAD_MIN_OUT
        and native.library() is not None
    )


def amx_wgrad() -> bool:
    """Whether bf16 weight gradients run on AMX tiles here (``native/weight_grad_amx.c``:
    fp32 results; 6-7x faster than the AVX512-BF16 kernel's ``vdpbf16ps`` on an AMX CPU,
    and than oneDNN's bf16 GEMM, which rounds them to bf16, 1.3x on config B's layers)."""
    return USE_NATIVE_WGRAD and USE_AMX_WGRAD and not _BF16_KERNEL_ON_AMX and gemm_amx.ready()


def native_bf16_wgrad() -> bool:
    """Whether bf16 weight gradients run on the AVX512-BF16 kernel here
    (``native/weight_grad_bf16.c``: the library loaded on a CPU with AVX512-BF16 and no
    AMX; an AMX CPU runs them on its tiles, through our kernel or oneDNN's GEMM)."""
    features = native.cpu_features()
    return (
        USE_NATIVE_WGRAD
        and bool(features & native.CPU_AVX512_BF16)
        and (_BF16_KERNEL_ON_AMX or not features & native.CPU_AMX_BF16)
    )


def bf16_instructions() -> bool:
    """Whether this CPU runs bf16 products in hardware (AVX512-BF16 or AMX-BF16), as the
    kernel library reads its features (False without the library)."""
    return bool(native.cpu_features() & (native.CPU_AVX512_BF16 | native.CPU_AMX_BF16))


def bf16_cpu_rows(g: torch.Tensor, x: torch.Tensor) -> bool:
    """What the bf16 kernels read: 2-D bf16 CPU tensors with contiguous rows, as many."""
    return (
        all(
            t.device.type == "cpu"
            and t.dtype == torch.bfloat16
            and t.dim() == 2
            and t.stride(1) == 1
            for t in (g, x)
        )
        and g.shape[0] == x.shape[0]
    )


def _native_bf16_wgrad_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    # any number of outputs: a logit's (256 -> 1) takes 0.05 ms more than torch's GEMV,
    # whose result is rounded to bf16, and its gradient comes out in fp32 like the rest
    return bf16_cpu_rows(g, x) and native_bf16_wgrad()


def narrow_layer(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a layer ``x [B, in] -> g [B, out]`` has a narrow input (13 -> 512): at
    most 32 inputs and a quarter of its outputs - too few to fill a kernel's lanes along
    ``in``, so the weight-gradient kernels run along ``out``."""
    return x.shape[1] <= 32 and 4 * x.shape[1] <= g.shape[1]


def weight_grad(
    g: torch.Tensor, x: torch.Tensor, bias_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense layer's weight gradient ``g^T x`` (``g [B, out]`` the output gradient,
    ``x [B, in]`` the input; ``[out, in]``, contiguous) and, with ``bias_grad``, the bias
    gradient ``g.sum(0)``. bf16 operands give fp32 results (sums in fp32), the dtype of
    the master weights they update.

    The native kernel reads ``g`` and ``x`` in place (rows of samples, any row stride);
    the intra-op threads split the outputs."""
    # a narrow input (13 -> 512) on a CPU: its 13 columns would fill 13 of the kernel's 16
    # lanes and leave it load-bound, so both CPU paths compute x^T g [in, out] and
    # transpose it (MKL: 0.83 -> 0.45 ms; the kernel on one thread: 0.66-0.70 -> 0.49-0.51)
    narrow = x.device.type == "cpu" and narrow_layer(g, x)
    bf16 = g.dtype == torch.bfloat16
    if bf16 and g.shape[1] * x.shape[1] >= _AMX_MIN_WEIGHTS and bf16_cpu_rows(g, x) and amx_wgrad():
        macs = g.shape[0] * g.shape[1] * x.shape[1]
        threads = torch.get_num_threads() if macs >= _AMX_MIN_MACS else 1
        done = gemm_amx.weight_grad(g, x, bias_grad, threads)
        if done is not None:
            return done
    if not (_native_bf16_wgrad_applies(g, x) if bf16 else _native_wgrad_applies(g, x)):
        dw = torch.mm(x.t(), g).t().contiguous() if narrow else torch.mm(g.t(), x)
        if bf16:
            # torch's bf16 GEMM rounds dw to bf16 (its sums are fp32); the bias gradient
            # likewise: a bf16 sum (fp32 inside) is 4x faster than sum(dtype=fp32), which
            # widens all of g first (config B's 2048 x 1024: 0.16 against 0.62 ms)
            return dw.float(), (g.sum(0).float() if bias_grad else None)
        return dw, (g.sum(0) if bias_grad else None)
    if narrow:
        dwt, db = _native_at_b(x, g, sum_b=bias_grad)
        return dwt.t().contiguous(), db
    return _native_at_b(g, x, sum_a=bias_grad)


def input_grad(
    g: torch.Tensor,
    w: torch.Tensor,
    relu_of: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias_grad: bool = False,
    x: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A dense layer's input gradient ``g [B, out] . w [out, in]`` as a fresh ``[B, in]``
    tensor of ``out_dtype``, zero where ``relu_of`` (the layer's input, a ReLU's output;
    None for none) is <= 0, as ``threshold_backward`` masks it; with ``bias_grad`` the
    layer's bias gradient ``g.sum(0)`` and with ``x`` (the layer's input) its weight
    gradient ``g^T x`` (fp32) where the pass gives them on the way, else None (the
    caller then computes them itself).

    bf16 on an AMX CPU: one pass of ``native/input_grad_amx.c`` (the mask and the cast to
    ``out_dtype`` as the product is stored, the bias sums as ``g`` is read, ``g`` and
    ``x`` packed as the AMX weight gradient's tiles, whose multiply follows);
    else torch's GEMM, the mask in place and the cast."""
    k, n = w.shape
    macs = g.shape[0] * k * n
    if (
        USE_AMX_IGRAD
        and 1 < k
        and k * n <= _AMX_IGRAD_MAX_WEIGHTS
        and out_dtype in (torch.bfloat16, torch.float32)
        and all(bf16_cpu_rows(g, t) for t in (g, relu_of, x) if t is not None)
        and w.is_contiguous()
        and w.dtype == torch.bfloat16
        and gemm_amx.ready()
    ):
        threads = torch.get_num_threads() if macs >= _AMX_MIN_MACS >> 2 else 1
        fuse = USE_AMX_FUSED_WGRAD and x is not None and amx_wgrad()
        done = gemm_amx.input_grad(
            g, w, relu_of, out_dtype, threads, bias_grad, x if fuse else None
        )
        if done is not None:
            return done
    g_in = g * w if k == 1 else torch.mm(g, w)  # k = 1 (a logit's): an outer product
    if relu_of is not None:  # g_in is our own fresh tensor: masked in place
        torch.ops.aten.threshold_backward.grad_input(g_in, relu_of, 0.0, grad_input=g_in)
    return g_in.to(out_dtype), None, None


def _native_at_b(
    a: torch.Tensor, b: torch.Tensor, sum_a: bool = False, sum_b: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``a^T b`` ``[m, n]`` for ``a [B, m]``, ``b [B, n]`` through native/weight_grad.c, and
    the column sums of ``a`` (``sum_a``) or of ``b`` (``sum_b``)."""
    lib = native.library()
    batch, m, n = a.shape[0], a.shape[1], b.shape[1]
    out = torch.empty(m, n)
    sums = torch.empty(m if sum_a else n) if (sum_a or sum_b) else None
    threads = torch.get_num_threads() if batch * m * n >= _WGRAD_MIN_MACS else 1
    if threads > 1 and m * n * 4 <= _WGRAD_BATCH_SPLIT_BYTES and batch >= 2 * _WGRAD_KC:
        return _native_at_b_batch_split(a, b, out, sums, sum_a, sum_b, threads)
    # threads take whole 6-row tiles of the result (no partial sums to add up: at
    # 1024 -> 1024 a batch split costs 7% more)
    tiles = -(-m // _WGRAD_TILE)
    fn, isa = _wgrad_kernel(a)
    size = a.element_size()

    def args(p: int, lo: int, hi: int) -> tuple:  # tiles [lo, hi)
        r0, r1 = _WGRAD_TILE * lo, min(m, _WGRAD_TILE * hi)
        a_sums = sums.data_ptr() + 4 * r0 if sum_a else None
        b_sums = sums.data_ptr() if sum_b and p == 0 else None  # b is whole in every part
        return (
            a.data_ptr() + size * r0,
            a.stride(0),
            b.data_ptr(),
            b.stride(0),
            out.data_ptr() + 4 * r0 * n,
            n,
            a_sums,
            b_sums,
            r1 - r0,
            n,
            batch,
            *isa,
        )

    rcs = native.parallel_call(lib, fn, tiles, args, threads, key=("wgrad/outputs", m, n, batch))
    failed = any(rcs)
    if failed:  # no memory for the packed blocks: torch's GEMM instead
        return _torch_at_b(a, b, sum_a, sum_b)
    return out, sums


def _wgrad_kernel(a: torch.Tensor) -> tuple[str, tuple]:
    """The native entry point for ``a``'s dtype and its trailing arguments."""
    if a.dtype == torch.bfloat16:
        return "recscale_weight_grad_bf16", ()
    return "recscale_weight_grad", (_WGRAD_ISA,)


def _torch_at_b(
    a: torch.Tensor, b: torch.Tensor, sum_a: bool, sum_b: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_native_at_b`'s results through torch (fp32, as the kernels give them)."""
    sums = a.sum(0, dtype=torch.float32) if sum_a else None
    sums = b.sum(0, dtype=torch.float32) if sum_b else sums
    return torch.mm(a.t(), b).float(), sums  # a, b: fp32 or bf16 CPU rows


def _native_at_b_batch_split(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sums: torch.Tensor | None,
    sum_a: bool,
    sum_b: bool,
    threads: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_native_at_b` with the threads splitting the samples: part ``p`` computes
    ``a[rows_p]^T b[rows_p]`` (part 0 into ``out``, the others into buffers) and the
    partial results are added. Each thread then packs only its own rows of both operands
    (an output split has every thread pack all of ``b``), and reads the rows that the
    GEMM before it wrote on the same core. Worth it while the result is small beside the
    operands (config A: 368 -> 512 4.48 -> 4.14 ms, 256 -> 64 0.55 -> 0.45)."""
    lib = native.library()
    batch, m, n = a.shape[0], a.shape[1], b.shape[1]
    parts = min(threads, batch // _WGRAD_KC)  # at least a packed block of samples each
    fn, isa = _wgrad_kernel(a)
    size = a.element_size()
    outs = [out] + [torch.empty(m, n) for _ in range(parts - 1)]
    part_sums = (
        [sums] + [torch.empty_like(sums) for _ in range(parts - 1)] if sums is not None else None
    )

    def args(p: int, r0: int, r1: int) -> tuple:  # samples [r0, r1)
        s = part_sums[p].data_ptr() if part_sums is not None else None
        return (
            a.data_ptr() + size * r0 * a.stride(0),
            a.stride(0),
            b.data_ptr() + size * r0 * b.stride(0),
            b.stride(0),
            outs[p].data_ptr(),
            n,
            s if sum_a else None,
            s if sum_b else None,
            m,
            n,
            r1 - r0,
            *isa,
        )

    # an even split: the partial sums are added, and must not depend on timing
    failed = any(native.parallel_call(lib, fn, batch, args, parts, adaptive=False))
    if failed:
        return _torch_at_b(a, b, sum_a, sum_b)
    return _sum_parts(outs), _sum_parts(part_sums) if sums is not None else None


def _narrow_input(x: torch.Tensor) -> bool:
    """``x [B, in]`` is what native/narrow_layer.c takes: fp32 CPU rows, ``in`` at most 13
    (DLRM's dense features), the native library loaded (AVX-512 kernels, else AVX2)."""
    return _fp32_cpu_rows(x) and 1 <= x.shape[1] <= _NARROW_MAX_IN and native.library() is not None


def _sum_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The threads' partial results added into the first, in part order (fixed: the
    split that made them is even, so the sum does not depend on timing)."""
    for p in parts[1:]:
        parts[0].add_(p)
    return parts[0]


def native_narrow_wgrad_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`narrow_weight_grad` runs natively for a layer ``x [B, in] -> g [B, out]``."""
    return USE_NATIVE_NARROW_WGRAD and _narrow_input(x) and _fp32_cpu_rows(g) and len(g) == len(x)


def narrow_weight_grad(
    g: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, bias_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`weight_grad` of a narrow-input layer (see :func:`native_narrow_wgrad_applies`)
    with the layer's ReLU mask applied on the way: ``g`` is zeroed where ``mask <= 0``
    (``mask`` is the layer's ReLU output, or None) for this product only - ``g`` itself is
    not modified. One streaming pass over ``g`` and ``mask`` (``native/narrow_layer.c``):
    the separate mask pass and the packing of ``g`` go."""
    batch, out, inp = g.shape[0], g.shape[1], x.shape[1]
    if mask is not None:
        assert mask.shape == g.shape and _fp32_cpu_rows(mask)
    lib = native.library()
    # threads split the samples (each reads the rows the GEMM before it wrote on its own
    # core); the partial results, [out, in] and [out], are added
    parts = min(torch.get_num_threads(), max(1, batch // 64))
    dws = [torch.empty(out, inp) for _ in range(parts)]
    dbs = [torch.empty(out) if bias_grad else None for _ in range(parts)]

    def args(p: int, r0: int, r1: int) -> tuple:  # samples [r0, r1)
        return (
            g.data_ptr() + 4 * r0 * g.stride(0),
            g.stride(0),
            mask.data_ptr() + 4 * r0 * mask.stride(0) if mask is not None else None,
            mask.stride(0) if mask is not None else 0,
            x.data_ptr() + 4 * r0 * x.stride(0),
            x.stride(0),
            dws[p].data_ptr(),
            inp,
            dbs[p].data_ptr() if bias_grad else None,
            out,
            inp,
            r1 - r0,
        )

    # added up: an even split
    failed = any(
        native.parallel_call(lib, "recscale_narrow_weight_grad", batch, args, parts, adaptive=False)
    )
    if failed:  # no memory for the kernel's buffers: torch's ops instead
        gm = g if mask is None else torch.where(mask > 0, g, 0.0)
        return torch.mm(x.t(), gm).t().contiguous(), (gm.sum(0) if bias_grad else None)
    return _sum_parts(dws), _sum_parts(dbs) if bias_grad else None


def native_narrow_forward_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`narrow_forward` runs natively for ``x [B, in] @ w^T``."""
    return (
        USE_NATIVE_NARROW_FORWARD
        and _narrow_input(x)
        and _fp32_cpu_rows(w)
        and w.shape[1] == x.shape[1]
        and native.has_avx512()  # the AVX2 twin lost to oneDNN (native/narrow_layer.c)
    )


def narrow_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, relu: bool
) -> torch.Tensor:
    """``x @ w^T + bias`` (then ReLU) for a narrow input (``w [out, in]``, rows contiguous;
    see :func:`native_narrow_wgrad_applies`) through ``native/narrow_layer.c``: oneDNN
    runs K = 13 at a fraction of its rate. The threads split the samples."""
    batch, inp, out = x.shape[0], x.shape[1], w.shape[0]
    h = torch.empty(batch, out)
    bias = bias.contiguous() if bias is not None else None
    lib = native.library()

    def args(_part: int, r0: int, r1: int) -> tuple:  # samples [r0, r1)
        return (
            x.data_ptr() + 4 * r0 * x.stride(0),
            x.stride(0),
            w.data_ptr(),
            w.stride(0),
            bias.data_ptr() if bias is not None else None,
            h.data_ptr() + 4 * r0 * out,
            out,
            out,
            inp,
            r1 - r0,
            int(relu),
        )

    threads = min(torch.get_num_threads(), max(1, batch // 64))
    failed = any(native.parallel_call(lib, "recscale_narrow_forward", batch, args, threads))
    if failed:  # no memory for w's transposed copy
        return linear(x, w, bias, relu=relu)
    return h


def native_logit_applies(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`logit_forward` / :func:`logit_backward` run natively for a logit
    layer ``h [B, n] -> [B, 1]`` with weight ``w [1, n]``."""
    return (
        USE_NATIVE_LOGIT
        and _fp32_cpu_rows(h, w)
        and w.shape[0] == 1
        and native.library() is not None
    )


def logit_forward(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``h @ w^T + b`` ``[B, 1]`` in one pass (``native/logit.c``; see
    :func:`native_logit_applies`)."""
    z = torch.empty(h.shape[0], 1)
    native.library().recscale_logit_forward(
        h.data_ptr(), h.stride(0), w.data_ptr(), float(b), z.data_ptr(), h.shape[0], h.shape[1]
    )
    return z


def logit_backward(
    h: torch.Tensor, w: torch.Tensor, dz: torch.Tensor, mask: bool, input_grad: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dh, dw [1, n], db [1])`` of :func:`logit_forward` from ``dz [B, 1]`` in one pass
    over ``h``; ``dh`` (with ``input_grad``) is zeroed where ``h <= 0`` when ``mask`` (``h``
    a ReLU output: the mask of its own gradient comes free)."""
    batch, n = h.shape
    dz = dz.contiguous()
    dw, db = torch.empty(1, n), torch.empty(1)
    dh = torch.empty(batch, n) if input_grad else None
    native.library().recscale_logit_backward(
        h.data_ptr(),
        h.stride(0),
        w.data_ptr(),
        dz.data_ptr(),
        dw.data_ptr(),
        db.data_ptr(),
        dh.data_ptr() if dh is not None else None,
        n,
        batch,
        n,
        int(mask),
    )
    return dh, dw, db
