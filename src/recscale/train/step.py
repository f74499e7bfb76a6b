"""The training step and the process set-up, shared by ``recscale train``, ``recscale
bench throughput`` and the calibration's whole steps (``bench/calibrate.py``), so the
benchmark times exactly what training runs.

One step::

    forward_loss      autocast(precision): model(batch) -> logits; fp32 BCE loss
    (the caller)      training: the global loss across ranks, NaN check, stop requests
    backward_and_step zero_grad; backward (the fused sparse optimizer updates the touched
                      embedding rows inside it); the dense optimizer's step
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from recscale import native
from recscale.config.errors import ConfigError, counted
from recscale.config.schema import Config
from recscale.data.batch import Batch
from recscale.launch_env import local_world_size
from recscale.native.team import flush_denormals
from recscale.train.host_memory import set_host_memory
from recscale.train.precision import (
    autocast,
    gemms,
    resolve_row_precision,
    set_matmul_precision,
)


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU. The test suite pins ``auto`` with
    ``RECSCALE_TEST_DEVICE`` (cpu by default), so ``RECSCALE_TEST_DEVICE=cuda pytest``
    runs every training test on the GPU and a plain ``pytest`` stays on the CPU."""
    if name == "auto":
        pinned = os.environ.get("RECSCALE_TEST_DEVICE")
        if not pinned:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if pinned not in ("cpu", "cuda"):  # a typo would be torch's traceback in every run
            raise ConfigError(
                "RECSCALE_TEST_DEVICE",
                f"the environment pins train.device=auto to {pinned!r}: set it to cpu or "
                "cuda, or unset it",
            )
        name = pinned
    if name == "cuda" and not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(
            "train.device",
            f"cuda was asked for, but {why} (torch {torch.__version__}); use cpu or auto",
        )
    return torch.device(name)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_note(threads: int, device: torch.device) -> str | None:
    """A line for a run whose ranks on this host ask for more CPU threads than it has
    cores (``train.threads`` set by hand): OpenMP teams larger than the cores take turns
    on them, and every parallel kernel waits for its slowest, descheduled thread."""
    ranks, cores = local_world_size(), available_cores()
    if device.type != "cpu" or threads * ranks <= cores:
        return None
    here = f" x {ranks} ranks on this host" if ranks > 1 else ""
    return (
        f"train.threads={threads}{here} is more threads than the {counted(cores, 'core')} "
        "this process may use: they take turns on them and every parallel kernel waits "
        "for its slowest thread (train.threads=0 uses the cores)"
    )


def setup_process(cfg: Config) -> tuple[torch.device, int]:
    """Seed, matmul precision, malloc's own behaviour for building the model, torch
    threads (the cores shared among this host's ranks) and ``embedding.row_precision``
    made concrete; returns ``(device, threads)``.
    ``train.host_memory`` applies from step 0 (``start_steps``)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    set_matmul_precision(t.precision)
    # a tier's initialization draws and frees blocks of GBs that no step reuses: under
    # "system" malloc unmaps them on free; retained, they stayed as holes in the heap
    set_host_memory("system")
    threads = t.threads or available_cores() // local_world_size() or 1
    torch.set_num_threads(threads)
    device = resolve_device(t.device)
    # subnormals as 0 on every CPU thread of the step (a GEMM fed subnormals runs a
    # microcode assist per value: DCNv2's step went 55 -> 500 ms within 30 steps)
    flush_denormals(native.library())
    resolve_row_precision(cfg, device)  # auto: what this device and precision gain from
    return device, threads


def start_steps(cfg: Config) -> bool:
    """Just before step 0 (after the model, any restore and the warm start): apply
    ``train.host_memory``; returns whether freed host memory is now retained."""
    return set_host_memory(cfg.train.host_memory)


def forward_loss(
    module: torch.nn.Module,
    batch: Batch,
    precision: str,
    device: torch.device,
    mark: Callable[[], Any] | None = None,
    check_finite: bool = False,
) -> torch.Tensor:
    """The step's forward: logits under ``precision``'s autocast, the loss in fp32.
    ``mark`` (a benchmark's clock) is called between the model's stages;
    ``check_finite`` makes the loss NaN when an activation is (see ``DLRM.forward``)."""
    with autocast(precision, device):
        logits = module(batch, mark=mark, check_finite=check_finite)
    return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)


def backward_and_step(
    loss: torch.Tensor,
    opt: torch.optim.Optimizer,
    precision: str,
    device: torch.device,
    mark: Callable[[], Any] | None = None,
) -> tuple[Any, Any]:
    """Backward (the fused sparse update runs inside it; its GEMMs as ``precision``'s
    forward ran them) then the dense step; returns a ``mark()`` after each
    (``perf_counter`` without one)."""
    mark = mark or time.perf_counter
    opt.zero_grad(set_to_none=True)
    with gemms(precision, device):
        loss.backward()
    t = mark()
    opt.step()
    return t, mark()
