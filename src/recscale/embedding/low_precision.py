"""Rows stored in fewer bits: ``embedding.row_precision = fp16 | bf16 | int8 | split_bf16``.

:class:`LowPrecisionStorage` keeps a table group's rows as::

    fp16 / bf16   weight [rows, D] half / bfloat16
    int8          weight [rows, D] uint8 codes, qparams [rows, 2] float32 = (scale, bias)
                  row r = weight[r] * scale[r] + bias[r]        (row-wise, as FBGEMM's
                  8-bit rows and Check-N-Run; scale = (max - min) / 255, bias = min)
    split_bf16    weight [rows, D] bfloat16 = the high 16 bits of each fp32 value,
                  low    [rows, D] int16    = its low 16 bits          (Split-SGD-BF16,
                  Kalamkar et al. SC20): the lookup reads the bf16 high halves (half the
                  bytes; the fp32 value truncated), the update rebuilds the exact fp32
                  value, applies the optimizer in fp32 and stores both halves - the
                  tables hold exactly what fp32 rows would after the same updates

and its optimizer state in fp32 (``DeviceStorage``'s buffers). A step reads the touched
rows into fp32, runs the sparse optimizer on them there, and stores them back with
**stochastic rounding** - an update smaller than the grid step still moves the row in
expectation (round-to-nearest would drop it: the DQRM and "low-precision SGD" point).
The rounding noise is a hash of (step, row, column), not a generator's draw, so a run
resumed from a checkpoint rounds exactly as the uninterrupted run does.

On a CPU with the native kernels, fp16/bf16 tables run the same fused lookup and
update as fp32 ones (``native/row_format.h``: rows decoded to fp32 in registers, the
update rounded back there); this file's torch code is their reference, bit for bit
(same noise, same rounding rule), and the path for int8, other devices and
``model.kernels`` other than auto/native.

``read_rows``/``write_rows`` speak fp32 (checkpoints, init, tests): a write rounds to
nearest. Lookups gather the rows, dequantize them to fp32 and pool in fp32.
"""

from __future__ import annotations

import sys

import torch

from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import DeviceStorage, pool_rows

_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.uint8,
    "split_bf16": torch.bfloat16,  # the high halves; the low ones in ``low``
}
# (mantissa bits, smallest normal exponent) of the float formats: the rounding grid
_GRID = {"fp16": (10, -14), "bf16": (7, -126)}


_M32 = 0xFFFFFFFF


def _signed64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def noise_bits(rows: torch.Tensor, dim: int, step: int) -> torch.Tensor:
    """``[len(rows), dim]`` int64 in [0, 2^16): a fixed function of (step, row, column),
    the one ``native/row_format.h`` computes - splitmix64's finalizer over (row, step) to
    32 bits a row, then murmur3's fmix32 of that + k * 0x9E3779B9 with one k per two
    columns: column j takes the low half of k = 8 * (j // 16) + j % 8 when j % 16 < 8,
    else its high half. int64 products wrap as the C's uint64 ones do; masks keep the
    32-bit part exact."""
    z = rows.to(torch.int64) * _signed64(0x9E3779B97F4A7C15) + _signed64(step * 0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed64(0x94D049BB133111EB)
    h = (z ^ _lsr(z, 31)) & _M32
    j = torch.arange(dim, device=rows.device, dtype=torch.int64)
    k = 8 * (j // 16) + j % 8
    v = (h.unsqueeze(1) + k * 0x9E3779B9) & _M32
    v = v ^ (v >> 16)
    v = (v * 0x85EBCA6B) & _M32
    v = v ^ (v >> 13)
    v = (v * 0xC2B2AE35) & _M32
    v = v ^ (v >> 16)
    return (v >> (16 * ((j // 8) % 2))) & 0xFFFF


def uniform_noise(rows: torch.Tensor, dim: int, step: int) -> torch.Tensor:
    """``noise_bits / 2^16``: values in [0, 1), exact in fp32."""
    return noise_bits(rows, dim, step).to(torch.float32) * (1.0 / (1 << 16))


def round_to_grid(x: torch.Tensor, precision: str, noise: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x`` -> fp16/bf16; ``noise=None`` rounds to nearest, else stochastically:
    of ``lo`` (toward zero) and ``hi`` (one step away from zero) take ``hi`` when
    ``noise < (|x| - |lo|) / (|hi| - |lo|)`` - unbiased (to the noise's 2^-16), and the
    rule ``native/row_format.h`` applies bit for bit. For bf16 (the top 16 bits of the
    float) that is ``noise * 2^16 < the 16 bits truncation drops``; for fp16 every term
    is exact in fp32 (|x| - |lo| by Sterbenz, the grid step a power of two)."""
    dtype = _DTYPES[precision]
    if noise is None:
        return x.to(dtype)
    x = x.contiguous()
    if precision == "bf16":
        bits = x.view(torch.int32)
        up = torch.floor(noise * 65536.0) < (bits & 0xFFFF)
        lo_bits = bits >> 16  # arithmetic: the low 16 bits are the pattern, sign included
    else:
        h = x.to(torch.float16)  # nearest; one step back toward zero where it went past x
        lo_bits = h.view(torch.int16).to(torch.int32)
        lo_bits = torch.where(h.to(torch.float32).abs() > x.abs(), lo_bits - 1, lo_bits)
        lo = lo_bits.to(torch.int16).view(torch.float16).to(torch.float32).abs()
        hi = (lo_bits + 1).to(torch.int16).view(torch.float16).to(torch.float32).abs()
        up = noise < (x.abs() - lo) / (hi - lo)
    return torch.where(up, lo_bits + 1, lo_bits).to(torch.int16).view(dtype)


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (bfloat16 high halves, int16 low halves): its bits, split exactly.
    On a little-endian host the halves are strided views of ``x``'s own 16-bit words
    (low word first): no arithmetic, no temporaries - with the two ``index_copy_`` of
    an encode, 12.5 against 29.0 ms for 65,536 rows of 128 (2026-11-28, Zen 4)."""
    x = x.contiguous()
    if sys.byteorder == "little":
        words = x.view(torch.int16).unflatten(-1, (-1, 2))
        return words[..., 1].view(torch.bfloat16), words[..., 0]
    bits = x.view(torch.int32)
    return (bits >> 16).to(torch.int16).view(torch.bfloat16), (bits & 0xFFFF).to(torch.int16)


def join_fp32(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`split_fp32`: the exact fp32 values."""
    bits = (high.view(torch.int16).to(torch.int32) << 16) | (low.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def quantize_rows(x: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[n, D]`` -> (uint8 codes, ``[n, 2]`` (scale, bias)); ``noise=None``: nearest."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(hi))
    t = (x - lo) / scale
    t = torch.round(t) if noise is None else torch.floor(t + noise)
    return t.clamp_(0, 255).to(torch.uint8), torch.cat([scale, lo], dim=1)


class LowPrecisionStorage(DeviceStorage):
    """A :class:`DeviceStorage` whose rows are stored at ``precision`` (module doc)."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        optimizer: SparseOptimizer,
        precision: str,
        device: torch.device | None = None,
        kernel: str = "auto",
    ) -> None:
        """``kernel``: ``auto``/``native`` let fp16/bf16 rows take the native fused lookup
        and update where they apply; anything else (and int8) runs this file's torch path."""
        if precision not in _DTYPES:
            raise ValueError(f"row precision must be one of {tuple(_DTYPES)}, got {precision!r}")
        if precision == "int8" or kernel not in ("auto", "native"):
            kernel = "torch"
        super().__init__(num_rows, dim, optimizer, device, kernel, _DTYPES[precision])
        self.precision = precision
        if precision == "int8":
            self.register_buffer("qparams", torch.zeros(num_rows, 2, device=device))
        if precision == "split_bf16":
            self.register_buffer(
                "low", torch.zeros(num_rows, dim, dtype=torch.int16, device=device)
            )

    def backward_kernel(self) -> str:
        # split rows: the native update (RS_SPLIT) or the torch path; numba knows no halves
        kernel = super().backward_kernel()
        return kernel if self.precision != "split_bf16" or kernel == "native" else "torch"

    def low_halves(self) -> torch.Tensor | None:
        return self.low if self.precision == "split_bf16" else None

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        if self.precision == "split_bf16":  # exact: both halves
            return join_fp32(self.weight.index_select(0, rows), self.low.index_select(0, rows))
        w = self.weight.index_select(0, rows).to(torch.float32)
        if self.precision == "int8":
            qp = self.qparams.index_select(0, rows)
            w = w * qp[:, :1] + qp[:, 1:]
        return w

    def _encode(self, rows: torch.Tensor, x: torch.Tensor, noise: torch.Tensor | None) -> None:
        if self.precision == "split_bf16":  # no rounding: the value's bits, both halves
            high, low = split_fp32(x)
            self.weight.index_copy_(0, rows, high)
            self.low.index_copy_(0, rows, low)
        elif self.precision == "int8":
            q, qp = quantize_rows(x, noise)
            self.weight.index_copy_(0, rows, q)
            self.qparams.index_copy_(0, rows, qp)
        else:
            self.weight.index_copy_(0, rows, round_to_grid(x, self.precision, noise))

    def lookup(self, rows, offsets, per_sample_weights, for_update=False):
        if self.precision == "split_bf16":  # the forward reads the high halves only
            w = self.weight.index_select(0, rows).to(torch.float32)
            return pool_rows(w, offsets, per_sample_weights)
        # gathered once (an id repeated in a batch is decoded twice: cheaper than unique)
        return pool_rows(self._decode(rows), offsets, per_sample_weights)

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        self.step.add_(1)
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


def device_rows(
    num_rows: int,
    dim: int,
    optimizer: SparseOptimizer,
    precision: str,
    device: torch.device | None = None,
    kernel: str = "auto",
) -> DeviceStorage:
    """Rows in device memory at ``precision``: a plain :class:`DeviceStorage` for fp32,
    else a :class:`LowPrecisionStorage` (plain tables and compressed factors alike).
    ``auto`` is fp32 here: a run makes it concrete before it builds (``train.precision``'s
    ``resolve_row_precision``); a model built outside a run keeps fp32 rows."""
    if precision in ("fp32", "auto"):
        return DeviceStorage(num_rows, dim, optimizer, device, kernel)
    return LowPrecisionStorage(num_rows, dim, optimizer, precision, device, kernel)


__all__ = [
    "LowPrecisionStorage",
    "join_fp32",
    "split_fp32",
    "quantize_rows",
    "round_to_grid",
    "noise_bits",
    "uniform_noise",
]
