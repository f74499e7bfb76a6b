"""Predict a training step's time before training: per-op cost laws measured on this
machine (``bench/calibrate.py``, saved as a ``Calibration``) summed over a config's
layers (``model``)."""

from recscale.perfmodel.calibration import Calibration, Law, default_path, find_calibration
from recscale.perfmodel.model import Prediction, calibrated_laws, predict

__all__ = [
    "Calibration",
    "Law",
    "Prediction",
    "calibrated_laws",
    "default_path",
    "find_calibration",
    "predict",
]
