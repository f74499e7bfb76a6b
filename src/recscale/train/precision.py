"""``train.precision``: the arithmetic of the MLPs and the interaction.

::

    fp32   plain fp32 everywhere (the default; what the CPU kernels are built for)
    tf32   fp32 tensors, GEMMs on TF32 tensor cores (CUDA; on a CPU it is fp32)
    bf16   autocast to bfloat16 for the MLPs and the interaction; parameters, embedding
           tables, optimizer state and the loss stay fp32 (master weights; a table's
           fp32 values may be kept as Split-SGD-BF16 halves, still exact)

The embedding lookup pools in fp32 and its fused optimizer updates in fp32: pooled rows
enter the interaction in fp32 and autocast casts them where a GEMM takes them. Under
bf16 on the CPU the rows default to Split-SGD-BF16 (``resolve_row_precision``): the
lookup reads each value's bf16 high half, the update the exact fp32 value.

On a CPU without bf16 instructions (AVX2, or AVX-512 without BF16/AMX) torch's own bf16
GEMMs run a scalar loop: 1 GFLOP/s against fp32's 178 on a 2-core AMD EPYC (AVX2), a
config A step 1.4 s instead of ~40 ms. There every bf16 GEMM of the step - forward and
backward - runs as an fp32 GEMM of its bf16 operands, its result rounded to bf16
(:class:`EmulatedBF16Gemms`): what a bf16 GEMM with fp32 accumulation computes, the
products and sums in another order. Everything else (which tensors are bf16, the
casts, the master weights) is autocast's as on a bf16 CPU.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recscale import native
from recscale.config.schema import Config
from recscale.embedding import kernels
from recscale.procfs import cpuinfo_field


def set_matmul_precision(precision: str) -> None:
    """Process-wide GEMM precision for ``precision`` (TF32 on for tf32 only)."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.allow_tf32 = precision == "tf32"


_aten = torch.ops.aten
# the GEMMs autocast hands bf16 operands on a CPU (linear and matmul decompose to these),
# and their backward's
_BF16_GEMMS = frozenset(
    (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.mv.default,
        _aten.addmv.default,
    )
)


class EmulatedBF16Gemms(TorchDispatchMode):
    """While active on this thread, a GEMM of bf16 CPU tensors runs in fp32 on the same
    values (a bf16 value is exactly an fp32 one) and its result is rounded to bf16 once:
    a bf16 GEMM with fp32 accumulation, at the fp32 GEMM's speed. Every other op runs as
    it would, through one Python call more: a config A step dispatches ~250 ops, and a
    mode that only passes them on cost it 2-5 ms of ~62 (2-core AMD EPYC, 2026-11-27)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in _disable_dynamo, whose first call imports
        # torch._dynamo: 1.7 s of every emulated bf16 run's start on a 2-vCPU EPYC.
        # Nothing runs under torch.compile in this mode (train/optimizer_methods.py).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _BF16_GEMMS and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 and a.device.type == "cpu"
            for a in args
        ):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def emulates_bf16(precision: str, device: torch.device) -> bool:
    """Whether ``precision``'s GEMMs on ``device`` run through :class:`EmulatedBF16Gemms`
    (bf16 on a CPU without bf16 instructions)."""
    return precision == "bf16" and device.type == "cpu" and bf16_hardware(device) == "emulated"


def gemms(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the step's backward runs in: the forward's GEMMs have their gradients'
    GEMMs there (:class:`EmulatedBF16Gemms` where bf16 is emulated, else nothing)."""
    return EmulatedBF16Gemms() if emulates_bf16(precision, device) else contextlib.nullcontext()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: bf16 autocast for ``bf16`` (its GEMMs
    emulated where the CPU has no bf16 instructions), else nothing."""
    if precision != "bf16":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
    stack.enter_context(gemms(precision, device))
    return stack


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags").split())


def bf16_hardware(device: torch.device) -> str:
    """What runs bf16 arithmetic here: ``cuda``; on a CPU ``amx`` (AMX-BF16 tiles),
    ``avx512_bf16`` (vdpbf16ps), or ``emulated`` (converted to fp32 around fp32
    instructions: correct, and no faster than fp32)."""
    if device.type == "cuda":
        return "cuda"
    features = native.cpu_features()
    flags = _cpu_flags()
    if features & native.CPU_AMX_BF16 or "amx_bf16" in flags:
        return "amx"
    if features & native.CPU_AVX512_BF16 or "avx512_bf16" in flags:
        return "avx512_bf16"
    return "emulated"


# bf16 is worth taking on a CPU when its GEMMs run at least this much faster than fp32's
BF16_GAIN = 1.2


@functools.lru_cache(maxsize=1)
def cpu_gemm_rates(m: int = 1024, k: int = 512, n: int = 512) -> tuple[float, float]:
    """This CPU's (fp32, bf16) GEMM rates in GFLOP/s, best of a few ``m x k @ k x n``
    products on torch's threads (~0.1 s, once a process). The flags alone do not say
    whether bf16 pays: an Intel Xeon VM without AMX (Emerald Rapids) runs oneDNN's
    avx512_bf16 GEMMs at half its fp32 rate, where a Zen 4 runs them at twice
    (docs/performance.md). Timed here, not by ``bench/hardware.py``'s probe: training
    sits below the bench layer.
    """
    rates = []
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        best = float("inf")
        # bf16's as a bf16 step runs them: emulated where the CPU has no bf16 instructions
        with gemms("bf16" if dtype == torch.bfloat16 else "fp32", cpu):
            for i in range(7):
                t = time.perf_counter()
                torch.mm(a, b)
                if i >= 2:  # the first products warm oneDNN's kernels and the caches
                    best = min(best, time.perf_counter() - t)
        rates.append(2 * m * k * n / best / 1e9)
    return rates[0], rates[1]


def tf32_note(precision: str, device: torch.device) -> str | None:
    """The line a tf32 run prints on a CPU without TF32 units (every one but AMX-TF32's):
    TF32 is the tensor cores' GEMM format (NVIDIA Ampere and later), so there the step's
    GEMMs stay fp32 and the run is fp32's, bit for bit."""
    if precision != "tf32" or device.type != "cpu" or "amx_tf32" in _cpu_flags():
        return None
    return (
        "train.precision=tf32 is a GPU GEMM format (NVIDIA Ampere and later): this CPU has "
        "no TF32 units, so the step's GEMMs stay fp32 and the run is fp32's "
        "(train.precision=bf16 is the CPU's low-precision mode)"
    )


def bf16_note(precision: str, device: torch.device) -> str | None:
    """The line a bf16 run on a CPU prints when bf16 will not pay there (no bf16
    instructions, or bf16 GEMMs measured slower than ``BF16_GAIN`` x fp32's), else None."""
    if precision != "bf16" or device.type != "cpu":
        return None
    hardware = bf16_hardware(device)
    fp32, bf16 = cpu_gemm_rates()
    measured = f"bf16 GEMMs ran at {bf16:.0f} GFLOP/s here against fp32's {fp32:.0f}"
    if hardware == "emulated":
        return (
            "train.precision=bf16 on this CPU is emulated (no AVX512-BF16 or AMX): its GEMMs "
            f"run in fp32 on bf16 values, bf16's results no faster than fp32 ({measured}) "
            "- it pays on CPUs with those (docs/performance.md)"
        )
    if bf16 < BF16_GAIN * fp32:
        return (
            f"train.precision=bf16 on this CPU ({hardware}): {measured} ({bf16 / fp32:.2f}x), "
            f"so expect bf16 no faster than fp32 on this host (docs/performance.md)"
        )
    return None


def resolve_row_precision(cfg: Config, device: torch.device) -> str:
    """``embedding.row_precision=auto`` (the default) made concrete for a run on
    ``device``, in ``cfg`` (its config.toml then records it), and returned.

    auto is **split_bf16** (Split-SGD-BF16: the lookup reads the bf16 high halves, the
    update stays exact fp32) where a bf16 run's lookup is the bytes it reads: on the
    CPU, plain tables in memory (``placement=device``, no compression), rows wider than
    a cache line in fp32 (dim > 16) holding at least half the values a sample's lookup
    reads, every table's lookup and update taken by the native kernels (the split rows'
    fast path; elsewhere they run through torch ops). Everywhere else it is fp32: an
    fp32 run, a GPU, a tier (its cache pools whole fp32 rows either way), compressed
    factors, narrow rows."""
    e = cfg.embedding
    if e.row_precision == "auto":
        e.row_precision = "split_bf16" if _split_rows_pay(cfg, device) else "fp32"
    return e.row_precision


# A row narrower than a cache line costs one line whether its values are 2 or 4 bytes.
CACHE_LINE_BYTES = 64


def _split_rows_pay(cfg: Config, device: torch.device) -> bool:
    e, m = cfg.embedding, cfg.model
    if cfg.train.precision != "bf16" or device.type != "cpu" or e.placement != "device":
        return False
    # Halving a row's bytes saves lines only where its fp32 row spans more than one:
    # config A's 64-byte rows (dim 16) read one line either way, and the split update
    # costs more (2026-11-28, Zen 4 VM: sparse 2.1-2.6 ms against 1.8-2.1 in fp32).
    dims = m.dims()
    if 2 * sum(d for d in dims if 4 * d > CACHE_LINE_BYTES) < sum(dims):
        return False
    if e.compression != "none" or e.table_compression or m.kernels not in ("auto", "native"):
        return False
    probe = torch.empty(1, 1, dtype=torch.bfloat16)
    return all(
        kernels.choose(m.kernels, op, probe, d) == "native"
        for d in set(dims)
        for op in ("lookup", "backward")
    )
