"""The training loop and evaluation (metrics: ``recscale.metrics``)."""

from recscale.train.parallel import evaluate
from recscale.train.run import TrainingDiverged, train

__all__ = ["TrainingDiverged", "evaluate", "train"]
