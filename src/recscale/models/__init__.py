"""Models built from modules/ (single device; sharding is applied from outside)."""

from recscale.models.dlrm import DLRM, build_model

__all__ = ["DLRM", "build_model"]
