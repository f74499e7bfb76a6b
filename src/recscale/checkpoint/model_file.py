"""A run directory's ``model.pt``: the whole model's state dict, which recscale versions
before per-rank checkpoints wrote at the end of training and ``recscale eval`` still
reads. It is checked as a checkpoint's ``dense.pt`` is, before any tensor is loaded:
a regular file of the run (no link, FIFO or device), plain tensors only
(``weights_only``: a planted pickle is refused, never run), and the model's every key
at its shape and dtype, finite - a foreign or damaged file had been a traceback, or
(NaN weights, a table's rows cut short) an evaluation of another model without a
word."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from recscale.checkpoint.format import CheckpointError, checked_file
from recscale.checkpoint.stored_rows import check_finite

MODEL_FILE = "model.pt"


def load_model_file(model: nn.Module, run_dir: Path) -> None:
    """``run_dir/model.pt`` into ``model`` (built from the run's config), or a
    CheckpointError naming the file and what in it no model file of this run holds."""
    path = checked_file(run_dir, MODEL_FILE)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler's errors vary by payload
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{path}: not a plain tensor file, refused to load it ({type(e).__name__}: {first})"
        ) from None
    if not isinstance(saved, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items()
    ):
        raise CheckpointError(f"{path}: not a model's state (a dict of name -> tensor)")
    want = model.state_dict()
    missing = [k for k in want if k not in saved]
    extra = [k for k in saved if k not in want]
    if missing or extra:
        raise CheckpointError(
            f"{path}: not this run's model ({len(missing)} of its tensors missing"
            + (f", e.g. {missing[0]}" if missing else "")
            + f"; {len(extra)} others"
            + (f", e.g. {extra[0]}" if extra else "")
            + "): a model file of another model or recscale version"
        )
    for name, mine in want.items():
        got = saved[name]
        if got.shape != mine.shape or got.dtype != mine.dtype:
            raise CheckpointError(
                f"{path}: {name} is {got.dtype} {list(got.shape)}, the run's model holds "
                f"{mine.dtype} {list(mine.shape)}"
            )
        check_finite(got, path, name)
    model.load_state_dict(saved)
