"""The training loop, evaluation and metrics."""

from recscale.train.metrics import auc, binary_metrics, logloss, normalized_entropy
from recscale.train.run import TrainingDiverged, evaluate, train

__all__ = [
    "TrainingDiverged",
    "auc",
    "binary_metrics",
    "evaluate",
    "logloss",
    "normalized_entropy",
    "train",
]
