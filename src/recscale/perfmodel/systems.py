"""What a training framework does that changes a step (``forecast.System``): the
forecast is for recscale's own step (``RECSCALE``); the others describe the published
systems ``benchmarks/forecast_validation.py`` checks the forecast against, each field
from that system's own documentation (the notes say where) or, where it publishes
nothing, an assumption said as one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    name: str
    fused_epilogue: bool = False  # bias + ReLU (and dReLU + bias grad) inside the GEMM
    fused_interaction: bool = False  # one dot-interaction kernel forward, one backward
    comm_overlap: float = 0.0  # share of the all-to-all hidden behind compute
    table_bytes: int = 4  # bytes a stored embedding value
    wire_bytes: int | None = None  # bytes a pooled value / dense gradient sent (None:
    # the precision's activation bytes - 2 under bf16/fp16, else 4)
    host_ms: float = 0.0  # host time a step on a GPU that the device does not hide
    note: str = ""


# recscale on a GPU: eager PyTorch (unfused epilogues, a bmm interaction), the Triton
# lookup and fused update, fp32 tables and wire, no overlap. Host time: config A at
# batch 16,384, TF32, on an H100 SXM (docs/gpu.md, 2026-11-24) measured 4.99 ms a step
# against 0.83 ms of device work forecast here; the rest (4.15 ms) is the eager step's
# Python, its synchronisations (the fused update sizes its output from the ids) and
# launches on that machine's host. Config B on the same GPU is the check (held out).
RECSCALE = System(
    "recscale",
    wire_bytes=4,
    host_ms=4.15,
    note="eager PyTorch: unfused epilogues, bmm interaction, fp32 tables and wire",
)

# NVIDIA DeepLearningExamples, PyTorch DLRM (github.com/NVIDIA/DeepLearningExamples,
# PyTorch/Recommendation/DLRM, README "Advanced" / "Performance"): a CUDA dot-interaction
# kernel, cuBLASLt MLPs with bias and ReLU fused, hybrid parallel (tables model
# parallel, MLPs data parallel), all-to-all not overlapped. Assumed: fp32 tables, the
# step device-bound at 8-64k samples a GPU (no host term).
DLE = System(
    "dle",
    fused_epilogue=True,
    fused_interaction=True,
    note="NVIDIA DeepLearningExamples PyTorch DLRM: fused interaction and MLP epilogues",
)
# HugeCTR's MLPerf DLRM-DCNv2 (MLCommons training results v4.0 / v5.0, NVIDIA's
# submission; HugeCTR release notes: fused GEMM + bias + ReLU forward and GEMM + dReLU +
# bias-grad backward, embedding and bottom-MLP overlap, whole-iteration CUDA graph).
# Assumed: half the all-to-all hidden, fp32 tables, fp16 on the wire.
HUGECTR = System(
    "hugectr",
    fused_epilogue=True,
    fused_interaction=True,
    comm_overlap=0.5,
    note="HugeCTR (MLPerf): fused epilogues, CUDA graph, embedding / bottom-MLP overlap",
)
# TorchRec's DLRM example (pytorch/torchrec examples/dlrm, FBGEMM TBE lookup and fused
# update, TrainPipelineSparseDist: the ids' all-to-all of batch t+1 overlaps step t).
# Assumed: an eager step's host time as recscale's, the ids' share hidden (~10%).
TORCHREC = System(
    "torchrec",
    comm_overlap=0.1,
    wire_bytes=4,
    host_ms=4.15,
    note="TorchRec DLRM example: eager PyTorch, FBGEMM TBE, pipelined input dist",
)
# Intel's MLPerf DLRM-DCNv2 on Xeon (MLCommons training results v3.1, Intel's
# submission: IPEX, bf16 on AMX, oneDNN GEMMs with fused post-ops). On a CPU the host
# is the device: every op pays its dispatch (Efficiency.kernel_s).
IPEX = System(
    "ipex",
    fused_epilogue=True,
    note="Intel Extension for PyTorch (MLPerf): bf16 AMX GEMMs with fused post-ops",
)

SYSTEMS = {s.name: s for s in (RECSCALE, DLE, HUGECTR, TORCHREC, IPEX)}
