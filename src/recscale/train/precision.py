"""``train.precision``: the arithmetic of the MLPs and the interaction.

::

    fp32   plain fp32 everywhere (the default; what the CPU kernels are built for)
    tf32   fp32 tensors, GEMMs on TF32 tensor cores (CUDA; on a CPU it is fp32)
    bf16   autocast to bfloat16 for the MLPs and the interaction; parameters, embedding
           tables, optimizer state and the loss stay fp32 (master weights)

The embedding lookup and its fused optimizer always run in fp32: pooled rows enter
the interaction in fp32 and autocast casts them where a GEMM takes them.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from recscale import native


def set_matmul_precision(precision: str) -> None:
    """Process-wide GEMM precision for ``precision`` (TF32 on for tf32 only)."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.allow_tf32 = precision == "tf32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: bf16 autocast for ``bf16``, else nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        best = float("inf")
        for i in range(7):
            t = time.perf_counter()
            torch.mm(a, b)
            if i >= 2:  # the first products warm oneDNN's kernels and the caches
                best = min(best, time.perf_counter() - t)
        rates.append(2 * m * k * n / best / 1e9)
    return rates[0], rates[1]


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
            f"train.precision=bf16 on this CPU is emulated (no AVX512-BF16 or AMX): correct, "
            f"but {measured} - it pays on CPUs with those (docs/performance.md)"
        )
    if bf16 < BF16_GAIN * fp32:
        return (
            f"train.precision=bf16 on this CPU ({hardware}): {measured} ({bf16 / fp32:.2f}x), "
            f"so expect bf16 no faster than fp32 on this host (docs/performance.md)"
        )
    return None
