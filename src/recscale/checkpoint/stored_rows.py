"""A stored part's rows as the checkpoint keeps them: fp32, fp16, or int8 rows with a
(scale, bias) pair each (row-wise, as Check-N-Run: ``scale = (max - min) / 255``,
``bias = min``, ``q = round((x - bias) / scale)``); read back in chunks and checked
finite before they reach a table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recscale.checkpoint.format import CheckpointError, read_array, read_rows


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = w.min(axis=1, initial=np.inf), w.max(axis=1, initial=-np.inf)
    if w.shape[0] == 0:
        return np.zeros(w.shape, np.uint8), np.zeros((0, 2), np.float32)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((w - lo[:, None]) / scale[:, None]), 0, 255).astype(np.uint8)
    return q, np.stack([scale, lo], axis=1).astype(np.float32)


def dequantize_int8(q: np.ndarray, qparams: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * qparams[:, :1] + qparams[:, 1:2]).astype(np.float32)


def stored_array_rows(path: Path, name: str, dtype, shape: tuple[int, ...], sel) -> np.ndarray:
    """The rows ``sel`` (a slice of a full part, or an increment's positions) of a
    stored array, in memory of their own."""
    if isinstance(sel, slice):
        return read_rows(path, name, dtype, shape, sel.start, sel.stop)
    return np.asarray(read_array(path, name, dtype, shape)[sel])


def read_weight(path: Path, base: str, precision: str, n: int, width: int, sel) -> np.ndarray:
    if precision == "fp32":
        return stored_array_rows(path, f"{base}.weight.f32", np.float32, (n, width), sel)
    if precision == "fp16":
        return stored_array_rows(path, f"{base}.weight.f16", np.float16, (n, width), sel).astype(
            np.float32
        )
    q = stored_array_rows(path, f"{base}.weight.q8", np.uint8, (n, width), sel)
    return dequantize_int8(
        q, stored_array_rows(path, f"{base}.qparams.f32", np.float32, (n, 2), sel)
    )


def check_stored_rows(rows: np.ndarray, row_lo: int, row_hi: int, path: Path, what: str) -> None:
    """An increment's row ids name rows of its own part, each once, in increasing order
    (as the writer stores them): ids outside ``[row_lo, row_hi)`` would be dropped by
    every rank's overlap and a repeated id would restore one row twice - a damaged or
    edited file, not a checkpoint to resume from."""
    if rows.size == 0:
        return
    if int(rows.min()) < row_lo or int(rows.max()) >= row_hi:
        bad = rows[(rows < row_lo) | (rows >= row_hi)][0]
        raise CheckpointError(
            f"{path}: {what} names row {int(bad)}, outside its part's rows [{row_lo}, {row_hi})"
        )
    if rows.size > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise CheckpointError(f"{path}: {what}'s row ids are not strictly increasing")


def check_finite(values: torch.Tensor, path: Path, what: str) -> None:
    """Rows restored are finite: NaN rows had resumed, and the run stopped at its first
    step advising lower learning rates for a checkpoint that was damaged."""
    if not values.is_floating_point() or values.numel() == 0:
        return
    # A finite sum means every value is finite (NaN and inf carry through a sum): one
    # pass and no temporary - isfinite() writes a bool a value (a 32 MB chunk of rows:
    # 30 ms, the sum 0.4). Only a sum that overflowed, or a damaged file, takes it.
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    if bool(values.sum(dtype=acc).isfinite()):
        return
    if not bool(torch.isfinite(values).all()):
        raise CheckpointError(f"{path}: {what} holds NaN or infinite values")
