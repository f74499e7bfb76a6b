"""Predict a training step's time before training: calibrated per-op laws (``calibrate``)
summed over a config's layers (``model``)."""

from recscale.perfmodel.calibrate import (
    Calibration,
    Law,
    calibrate,
    default_path,
    find_calibration,
)
from recscale.perfmodel.model import Prediction, predict

__all__ = [
    "Calibration",
    "Law",
    "Prediction",
    "calibrate",
    "default_path",
    "find_calibration",
    "predict",
]
