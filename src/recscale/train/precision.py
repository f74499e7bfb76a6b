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

import torch


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
