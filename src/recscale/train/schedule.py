"""The learning-rate schedule: one factor per step for the dense and embedding rates.

``optimizer.warmup_steps`` W, ``decay_start`` S, ``decay_steps`` D, ``decay`` (polynomial:
squared, as the reference DLRM's; or linear) and ``decay_to`` E give, for step t (1-based,
the step being taken)::

    t <= W              t / W                      linear warm-up
    W < t <= S          1
    S < t <= S + D      E + (1 - E) * ((S + D - t) / D) ** p      p = 2 (polynomial) or 1
    t > S + D           E

A pure function of the step: a resumed run continues on the same curve.
"""

from __future__ import annotations

from recscale.config.schema import DenseOptimizerConfig


def lr_factor(cfg: DenseOptimizerConfig, step: int) -> float:
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if not cfg.decay_steps or step <= cfg.decay_start:
        return 1.0
    left = cfg.decay_start + cfg.decay_steps - step
    if left <= 0:
        return cfg.decay_to
    power = 2.0 if cfg.decay == "polynomial" else 1.0
    return cfg.decay_to + (1.0 - cfg.decay_to) * (left / cfg.decay_steps) ** power


def schedule_note(cfg: DenseOptimizerConfig, steps: int) -> str | None:
    """A line for a schedule the run's ``steps`` do not reach the shape of: a warm-up
    longer than the run (the rates never reach optimizer.lr and embedding.lr) or a decay
    that starts after its last step (it never acts)."""
    if cfg.warmup_steps > steps:
        return (
            f"optimizer.warmup_steps={cfg.warmup_steps} is longer than the run's "
            f"{steps} steps: the learning rates climb to {100 * steps / cfg.warmup_steps:.3g}% "
            "of optimizer.lr and embedding.lr by its last step"
        )
    if cfg.decay_steps and cfg.decay_start >= steps:
        return (
            f"optimizer.decay_start={cfg.decay_start} is at or past the run's {steps} "
            "steps: the decay never begins"
        )
    return None


def scheduled(cfg: DenseOptimizerConfig) -> bool:
    return bool(cfg.warmup_steps or cfg.decay_steps)


class LRSchedule:
    """Sets the dense optimizer's and every embedding storage's rate for each step."""

    def __init__(self, cfg: DenseOptimizerConfig, dense_opt, storages, sparse_lr: float) -> None:
        self.cfg, self.dense_opt, self.storages = cfg, dense_opt, list(storages)
        self.dense_lrs = [g["lr"] for g in dense_opt.param_groups]
        self.sparse_lr = sparse_lr

    def step(self, step: int) -> float:
        """Apply the rates of ``step`` (1-based); returns the factor."""
        f = lr_factor(self.cfg, step)
        for g, lr in zip(self.dense_opt.param_groups, self.dense_lrs):
            g["lr"] = lr * f
        for s in self.storages:
            s.optimizer.lr = self.sparse_lr * f
        return f
