"""The standard torch optimizer for the dense (MLP) parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from recscale.config.schema import DenseOptimizerConfig


def build_dense_optimizer(
    cfg: DenseOptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown dense optimizer {cfg.name!r}")
