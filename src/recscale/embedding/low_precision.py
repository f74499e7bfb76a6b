"""Rows stored in fewer bits: ``embedding.row_precision = fp16 | bf16 | int8``.

:class:`LowPrecisionStorage` keeps a table group's rows as::

    fp16 / bf16   weight [rows, D] half / bfloat16
    int8          weight [rows, D] uint8 codes, qparams [rows, 2] float32 = (scale, bias)
                  row r = weight[r] * scale[r] + bias[r]        (row-wise, as FBGEMM's
                  8-bit rows and Check-N-Run; scale = (max - min) / 255, bias = min)

and its optimizer state in fp32 (``DeviceStorage``'s buffers). A step reads the touched
rows into fp32, runs the sparse optimizer on them there, and stores them back with
**stochastic rounding** - an update smaller than the grid step still moves the row in
expectation (round-to-nearest would drop it: the DQRM and "low-precision SGD" point).
The rounding noise is a hash of (step, row, column), not a generator's draw, so a run
resumed from a checkpoint rounds exactly as the uninterrupted run does.

``read_rows``/``write_rows`` speak fp32 (checkpoints, init, tests): a write rounds to
nearest. Lookups gather the rows, dequantize them to fp32 and pool in fp32.
"""

from __future__ import annotations

import torch

from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import DeviceStorage, pool_rows

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}
# (mantissa bits, smallest normal exponent) of the float formats: the rounding grid
_GRID = {"fp16": (10, -14), "bf16": (7, -126)}


def bytes_per_value(precision: str) -> float:
    """Stored bytes of one row element (int8 adds 8 bytes a row: see ``row_overhead``)."""
    return {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[precision]


def row_overhead(precision: str) -> int:
    """Bytes a row carries beside its values (int8: its scale and bias)."""
    return 8 if precision == "int8" else 0


def uniform_noise(rows: torch.Tensor, dim: int, step: int) -> torch.Tensor:
    """``[len(rows), dim]`` values in [0, 1), a fixed function of (step, row, column):
    a 64-bit multiply-xorshift mix (splitmix64's constants), wrapping as int64 does."""
    x = rows.to(torch.int64).unsqueeze(1) * dim + torch.arange(dim, device=rows.device)
    salt = (step * 0xBF58476D1CE4E5B9 + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap
    x = x * -7046029254386353131 + salt  # 0x9E3779B97F4A7C15 as int64
    x = x ^ (x >> 31)
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    x = x ^ (x >> 29)
    return (x & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def round_to_grid(x: torch.Tensor, precision: str, noise: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x`` -> the fp16/bf16 tensor of the neighbour chosen by ``noise`` (stochastic:
    up with probability equal to the distance from the lower neighbour in grid steps);
    ``noise=None`` rounds to nearest."""
    dtype = _DTYPES[precision]
    if noise is None:
        return x.to(dtype)
    mant, min_exp = _GRID[precision]
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0**min_exp)))
    ulp = torch.exp2(exp - mant)  # the grid step at x (subnormals: the smallest normal's)
    lo = torch.floor(x / ulp) * ulp  # exact: x / ulp < 2^(mant+1) fits fp32's mantissa
    return torch.where(noise < (x - lo) / ulp, lo + ulp, lo).to(dtype)


def quantize_rows(x: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[n, D]`` -> (uint8 codes, ``[n, 2]`` (scale, bias)); ``noise=None``: nearest."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(hi))
    t = (x - lo) / scale
    t = torch.round(t) if noise is None else torch.floor(t + noise)
    return t.clamp_(0, 255).to(torch.uint8), torch.cat([scale, lo], dim=1)


class LowPrecisionStorage(DeviceStorage):
    """A :class:`DeviceStorage` whose rows are stored at ``precision`` (module doc)."""

    def __init__(self, num_rows: int, dim: int, optimizer: SparseOptimizer, precision: str,
                 device: torch.device | None = None) -> None:  # fmt: skip
        if precision not in _DTYPES:
            raise ValueError(f"row precision must be one of {tuple(_DTYPES)}, got {precision!r}")
        super().__init__(num_rows, dim, optimizer, device, "torch", _DTYPES[precision])
        self.precision = precision
        if precision == "int8":
            self.register_buffer("qparams", torch.zeros(num_rows, 2, device=device))

    def native_lookup_table(self) -> torch.Tensor | None:
        return None  # the native kernels read fp32 rows

    def backward_kernel(self) -> str:
        return "torch"  # the reference path: merged gradients into apply_gradients

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        w = self.weight.index_select(0, rows).to(torch.float32)
        if self.precision == "int8":
            qp = self.qparams.index_select(0, rows)
            w = w * qp[:, :1] + qp[:, 1:]
        return w

    def _encode(self, rows: torch.Tensor, x: torch.Tensor, noise: torch.Tensor | None) -> None:
        if self.precision == "int8":
            q, qp = quantize_rows(x, noise)
            self.weight.index_copy_(0, rows, q)
            self.qparams.index_copy_(0, rows, qp)
        else:
            self.weight.index_copy_(0, rows, round_to_grid(x, self.precision, noise))

    def lookup(self, rows, offsets, per_sample_weights, for_update=False):
        # gathered once (an id repeated in a batch is decoded twice: cheaper than unique)
        return pool_rows(self._decode(rows), offsets, per_sample_weights)

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        self.step += 1
        w = self._decode(rows)
        state = self.optimizer_state()
        local = {name: t.index_select(0, rows) for name, t in state.items()}
        idx = torch.arange(rows.shape[0], device=rows.device)
        self.optimizer.update_(w, local, idx, grad, int(self.step))
        for name, t in state.items():
            t.index_copy_(0, rows, local[name])
        self._encode(rows, w, uniform_noise(rows, self.dim, int(self.step)))

    def read_rows(self, rows):
        return self._decode(rows)

    def read_state(self, rows):
        state = super().read_state(rows)
        if self.precision == "int8":  # so a checkpoint restores the very same codes
            qp = self.qparams.index_select(0, rows)
            state.update(qscale=qp[:, 0], qbias=qp[:, 1])
        return state

    @torch.no_grad()
    def write_state(self, rows, state):
        super().write_state(rows, state)  # the optimizer's names
        if self.precision != "int8" or "qscale" not in state:
            return
        # After write_rows (nearest, its own scale): re-encode on the saved grid, so a
        # resumed run holds the codes the interrupted one did - where that grid fits the
        # rows (a part restored from another column cut keeps write_rows' encoding).
        rows = rows.to(self.weight.device)
        v = self._decode(rows)
        scale = state["qscale"].to(v).unsqueeze(1)
        bias = state["qbias"].to(v).unsqueeze(1)
        q = torch.round((v - bias) / scale).clamp_(0, 255)
        fits = ((q * scale + bias - v).abs() <= 0.25 * scale).all(dim=1)
        keep = rows[fits]
        self.weight.index_copy_(0, keep, q[fits].to(torch.uint8))
        self.qparams.index_copy_(0, keep, torch.cat([scale, bias], 1)[fits])

    @torch.no_grad()
    def write_rows(self, rows, values):
        rows = rows.to(self.weight.device)
        self._encode(rows, values.to(self.weight.device, torch.float32), None)


def table_bytes(num_rows: int, dim: int, precision: str) -> int:
    """Stored bytes of a table's rows (no optimizer state)."""
    return int(num_rows * (dim * bytes_per_value(precision) + row_overhead(precision)))


__all__ = [
    "LowPrecisionStorage",
    "bytes_per_value",
    "quantize_rows",
    "round_to_grid",
    "row_overhead",
    "table_bytes",
    "uniform_noise",
]
