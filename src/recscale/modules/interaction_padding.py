"""How the interactions pad their shapes, as plain numbers (no torch): the module pads
its tensors by these and the performance model prices the padded shapes."""

from __future__ import annotations

# The top MLP's first GEMM runs ~15% faster when its input width is a multiple of 8
# (367 -> 368 for config A on AVX2); the pad columns are always zero, so their weights
# never receive a gradient and the model is mathematically the unpadded one.
PAD_MULTIPLE = 8


def gram_multiple(accelerator: bool, half: bool) -> int:
    """16 bytes of rows on an accelerator (4 fp32 / TF32, 8 bf16 / fp16); none on a CPU
    (the performance model pads as the module does through this)."""
    return (8 if half else 4) if accelerator else 1
