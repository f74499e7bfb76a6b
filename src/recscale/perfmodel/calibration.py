"""A calibration: this machine's per-op cost laws and step constants, as saved by
``recscale bench calibrate`` (``bench/calibrate.py`` measures them; ``fit.py`` fits
them) and read by the performance model (``model.py``). Plain JSON::

    {"machine": ..., "threads": T, "laws": {"mlp_forward": {"features": [...],
     "coef": [...], "fit_error": e}, ...}, "step_scale": s, "step_overhead": o,
     "world_size": W, "format": 3}

The laws and their features are listed in ``bench/calibrate.py``'s docstring.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recscale.config.small_files import (
    loads_json,
    read_small_text,
    user_cache_dir,
    write_text_atomic,
)

FORMAT = 3


@dataclass
class Law:
    """``t = sum(coef_i * feature_i)`` seconds; ``features`` names them (see module doc)."""

    features: list[str]
    coef: list[float]
    fit_error: float = 0.0  # median relative error on the calibration points

    def __call__(self, **x: float) -> float:
        return sum(c * x[f] for f, c in zip(self.features, self.coef))


@dataclass
class Calibration:
    machine: str
    threads: int
    laws: dict[str, Law] = field(default_factory=dict)
    step_scale: float = 1.0
    step_overhead: float = 0.0
    world_size: int = 1  # local ranks the whole steps of the fit ran on
    format: int = FORMAT

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            d = loads_json(read_small_text(path, "distributed.calibration"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a calibration (not JSON: {e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: not a calibration (not a JSON object)")
        if d.get("format") != FORMAT:
            raise ValueError(
                f"{path}: calibration format {d.get('format')}; run `recscale bench calibrate` "
                "again"
            )
        try:
            laws = {k: _law(k, v) for k, v in d.pop("laws").items()}
            cal = cls(**{**d, "laws": laws})
            cal.check()
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(
                f"{path}: not a calibration ({e}); run `recscale bench calibrate` again"
            ) from None
        return cal

    def check(self) -> None:
        """Every number a real one, every law the model reads present (ValueError if not)."""
        for name in REQUIRED_LAWS:
            if name not in self.laws:
                raise ValueError(f"no {name!r} law")
        if not isinstance(self.threads, int) or not isinstance(self.world_size, int):
            raise ValueError("threads and world_size must be integers")
        for key in ("step_scale", "step_overhead"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{key} is {v!r}")


def mlp_features(m: int, k: int, n: int) -> dict[str, float]:
    """The MLP laws' features of a ``[m, k] @ [k, n]`` layer (see bench/calibrate.py)."""
    return {
        "flops2": 2.0 * m * k * n,
        "flops4": 4.0 * m * k * n,
        "mn": float(m * n),
        "mk": float(m * k),
        "kn": float(k * n),
        "one": 1.0,
    }


# the laws ``model.predict`` and ``planner_laws`` read (the collectives' are optional)
REQUIRED_LAWS = ("mlp_forward", "mlp_backward", "interaction", "lookup", "update", "dense_opt")


def _law(name: str, v: dict) -> Law:
    law = Law(**v)
    if not (
        isinstance(law.features, list)
        and isinstance(law.coef, list)
        and len(law.features) == len(law.coef)
        and all(isinstance(f, str) for f in law.features)
        and all(isinstance(c, (int, float)) and math.isfinite(c) and c >= 0 for c in law.coef)
    ):
        raise ValueError(f"law {name!r} is not features with non-negative coefficients")
    return law


def default_path() -> Path:
    """This host's calibration file (``user_cache_dir``; the working directory when the
    user has no home)."""
    base = user_cache_dir() or Path.cwd()
    return base / f"calibration-{platform.node() or 'host'}.json"


def find_calibration(spec: str = "auto") -> Calibration | None:
    """``auto``: this host's saved calibration, None when there is none or it is of an
    older format; ``none``: None; else a file path (missing or unreadable: an error)."""
    if spec == "none":
        return None
    path = default_path() if spec == "auto" else Path(spec)
    if not path.exists():
        if spec == "auto":
            return None
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        if spec == "auto":  # a stale file: as without one
            return None
        raise
