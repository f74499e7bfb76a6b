"""The two files rank 0 writes beside the tables, read with every check before anything
is taken from them: ``dense.pt`` (the dense weights and optimizer, plain tensors only)
and ``trainer.json`` (the step, the data position, the generator state)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale.checkpoint.format import CheckpointError, checked_file
from recscale.config.small_files import loads_json


def load_dense(path: Path) -> dict[str, Any]:
    """``dense.pt``, loaded as tensors and plain containers only (``weights_only``): a
    planted pickle is refused, never run."""
    try:
        return torch.load(
            io.BytesIO(checked_file(path, "dense.pt").read_bytes()),
            map_location="cpu",
            weights_only=True,
        )
    except Exception as e:  # noqa: BLE001 - the unpickler's errors vary by payload
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path / 'dense.pt'}: not a plain tensor file, refused to load it ({first})"
        ) from e


def trainer_state(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``trainer.json`` checked before anything is taken from it: an object whose step is
    the manifest's (an int; a forged or mismatched one had resumed at step -5, or at the
    wrong step) and whose generator state, if any, is one (a traceback otherwise).
    ``torch_rng`` comes back decoded (uint8)."""
    try:
        trainer = loads_json(checked_file(path, "trainer.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: trainer.json is not JSON ({e})") from None
    step = trainer.get("step") if isinstance(trainer, dict) else None
    if type(step) is not int or step != manifest["step"]:
        raise CheckpointError(
            f"{path}: trainer.json's step {step!r} is not the manifest's {manifest['step']}"
        )
    if "torch_rng" in trainer:
        try:
            rng = np.frombuffer(base64.b64decode(trainer["torch_rng"], validate=True), np.uint8)
        except (TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise CheckpointError(f"{path}: trainer.json's torch_rng is not base64 ({e})") from None
        if rng.size != torch.get_rng_state().numel():
            raise CheckpointError(
                f"{path}: trainer.json's torch_rng holds {rng.size} bytes, not a generator "
                f"state's {torch.get_rng_state().numel()}"
            )
        trainer = {**trainer, "torch_rng": rng.copy()}
    return trainer
