"""Sparse optimizers fused into the embedding backward.

Each optimizer updates only the rows a batch touched. It receives *unique* rows
(duplicates already merged by summing their gradients) and updates the weight and
its per-row state in place::

    weight  [R, D]          the storage's rows (a whole table group, or a cache)
    state   {name: [R, ...]} per-row optimizer state, indexed like weight
    rows    [U] int64       unique row indices into weight/state
    grad    [U, D] float32  summed gradient of each row

Because the update only touches ``weight[rows]`` and ``state[*][rows]``, a tiered
storage can call it on its cache tensors with cache slots as ``rows``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from recscale.config.schema import EmbeddingConfig
from recscale.embedding.sizing import optimizer_state_shapes


class SparseOptimizer(ABC):
    name: str

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """Per-row state: name -> trailing shape (``()`` is one float per row)."""
        return optimizer_state_shapes(self.name, dim)

    def init_value(self, name: str) -> float:
        return 0.0

    @abstractmethod
    def update_(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
    ) -> None:
        """Apply one step to ``weight[rows]`` (and state) given the merged ``grad``.

        ``step`` counts the updates applied to this storage, starting at 1.
        """


class SparseSGD(SparseOptimizer):
    name = "sgd"

    def update_(self, weight, state, rows, grad, step) -> None:
        weight.index_add_(0, rows, grad, alpha=-self.lr)


class SparseRowwiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row.

    ``acc[r] += mean(g_r ** 2)``; ``w_r -= lr * g_r / (sqrt(acc[r]) + eps)``.
    """

    name = "rowwise_adagrad"

    def __init__(self, lr: float, eps: float = 1e-8, initial_accumulator: float = 0.0) -> None:
        super().__init__(lr)
        self.eps = eps
        self.initial_accumulator = initial_accumulator

    def init_value(self, name: str) -> float:
        return self.initial_accumulator

    def update_(self, weight, state, rows, grad, step) -> None:
        acc = state["sum"]
        acc.index_add_(0, rows, grad.pow(2).mean(dim=1))
        scale = acc.index_select(0, rows).sqrt_().add_(self.eps).reciprocal_().mul_(-self.lr)
        weight.index_add_(0, rows, grad * scale.unsqueeze(1))


class SparseAdam(SparseOptimizer):
    """Lazy Adam: moments of touched rows only, as ``torch.optim.SparseAdam``.

    The bias correction uses the optimizer's global step count, not per-row counts.
    """

    name = "adam"

    def __init__(
        self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def update_(self, weight, state, rows, grad, step) -> None:
        b1, b2 = self.beta1, self.beta2
        m = state["exp_avg"].index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        v = state["exp_avg_sq"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        step_size = self.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        weight.index_add_(0, rows, m.div_(v.sqrt_().add_(self.eps)), alpha=-step_size)


@dataclass(frozen=True)
class FusedParams:
    """An optimizer's step as plain numbers, for the fused kernels (C, numba, Triton):
    ``kind`` 0 SGD, 1 row-wise Adagrad, 2 Adam; Adam's bias correction is folded into
    ``step_size``; ``state_names`` in the order the kernels take the state tensors."""

    kind: int
    lr: float
    eps: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    step_size: float = 0.0
    state_names: tuple[str, ...] = ()


SGD_KIND, ROWWISE_ADAGRAD_KIND, ADAM_KIND = 0, 1, 2


def fused_params(optimizer: SparseOptimizer, step: int) -> FusedParams:
    """``optimizer``'s ``step``-th update for a fused kernel (see :class:`FusedParams`)."""
    if isinstance(optimizer, SparseSGD):
        return FusedParams(SGD_KIND, float(optimizer.lr))
    if isinstance(optimizer, SparseRowwiseAdagrad):
        return FusedParams(
            ROWWISE_ADAGRAD_KIND, float(optimizer.lr), optimizer.eps, state_names=("sum",)
        )
    if isinstance(optimizer, SparseAdam):
        b1, b2 = optimizer.beta1, optimizer.beta2
        size = optimizer.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        return FusedParams(
            ADAM_KIND, float(optimizer.lr), optimizer.eps, b1, b2, size, ("exp_avg", "exp_avg_sq")
        )
    raise TypeError(f"no fused kernel for {type(optimizer).__name__}")


def build_sparse_optimizer(cfg: EmbeddingConfig) -> SparseOptimizer:
    if cfg.optimizer == "sgd":
        return SparseSGD(cfg.lr)
    if cfg.optimizer == "rowwise_adagrad":
        return SparseRowwiseAdagrad(cfg.lr, cfg.eps, cfg.initial_accumulator)
    if cfg.optimizer == "adam":
        return SparseAdam(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps)
    raise ValueError(f"unknown sparse optimizer {cfg.optimizer!r}")
