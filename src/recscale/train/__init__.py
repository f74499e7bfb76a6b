"""The training loop and evaluation (metrics: ``recscale.metrics``)."""

from recscale.train.run import TrainingDiverged, evaluate, train

__all__ = ["TrainingDiverged", "evaluate", "train"]
