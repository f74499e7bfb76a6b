"""The standard torch optimizer for the dense (MLP) parameters (SGD on a CPU: torch's,
with the bf16 node's weight copies written in its step, ``train/dense_sgd.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from recscale.config.schema import DenseOptimizerConfig
from recscale.train.dense_sgd import ONE_THREAD_BELOW, SGDWithBF16Copies
from recscale.train.optimizer_methods import SGD, Adagrad, Adam


def build_dense_optimizer(
    cfg: DenseOptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    params = list(params)
    # torch's fused (single-kernel) implementations: on CPU, Adam 1.1 -> 0.26 ms and
    # Adagrad 0.76 -> 0.21 ms per step for config A's MLPs; same update rule. Not SGD on
    # a CPU: its fused kernel is the slow one there (0.71 ms against foreach's 0.29).
    # Fused kernels exist on CPU for all three and on CUDA for Adam and SGD only
    # (torch's fused Adagrad is CPU-only): elsewhere torch's default (foreach) runs.
    devices = {"adam": ("cpu", "cuda"), "sgd": ("cuda",)}.get(cfg.name, ("cpu",))
    fused = bool(params) and all(
        p.device.type in devices and p.dtype.is_floating_point for p in params
    )
    kw = {"fused": True} if fused else {}
    if cfg.name == "adam":
        opt = Adam(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, **kw)
    elif cfg.name == "adagrad":
        opt = Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, **kw)
    elif cfg.name == "sgd":
        # on a CPU: the subclass whose step also writes the bf16 node's weight copies
        sgd = SGD if fused else SGDWithBF16Copies
        opt = sgd(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)
    else:
        raise ValueError(f"unknown dense optimizer {cfg.name!r}")
    # below ONE_THREAD_BELOW parameters a CPU step runs on one thread: torch opens a
    # parallel region per tensor, and waking the other threads costs more than they save
    # (SGDWithBF16Copies chooses its own threads)
    on_cpu = params and all(p.device.type == "cpu" for p in params)
    if on_cpu and not isinstance(opt, SGDWithBF16Copies):
        if sum(p.numel() for p in params) < ONE_THREAD_BELOW:
            _step_on_one_thread(opt)
    return opt


def _step_on_one_thread(opt: torch.optim.Optimizer) -> None:
    """Run ``opt.step`` with one intra-op thread, restoring the count after."""
    saved: list[int] = []

    def pre(*_):
        saved.append(torch.get_num_threads())
        torch.set_num_threads(1)

    def post(*_):
        torch.set_num_threads(saved.pop())

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
