"""Compressed tables: rows computed from smaller factor tables, fused into the lookup
and the sparse optimizers (``embedding.compression = qr | mixed_dim | tt``).

A :class:`FactoredStorage` serves one table of ``num_rows x dim`` *virtual* rows. It
holds factor tables, each a :class:`DeviceStorage` with its own sparse optimizer (so a
factor row is updated exactly as a plain row would be: no dense gradient of any table),
and a ``combine`` that builds virtual rows from gathered factor rows::

    qr         Q [ceil(n/m), D'], R [m, D']           row i = Q[i // m] (*|+|++) R[i % m]
               (Shi et al., "Compositional Embeddings Using Complementary Partitions")
    mixed_dim  W [n, d_t], P [d_t, D]                 row i = W[i] @ P
               (Ginart et al., "Mixed Dimension Embeddings"; d_t by the power rule)
    tt         G1 [n1, d1 R], G2 [n2, R d2 R], G3 [n3, R d3], n1 n2 n3 >= n, d1 d2 d3 = D
               row i = G1[i1] G2[i2] G3[i3]  (i = (i1 n2 + i2) n3 + i3; Yin et al., TT-Rec)

Forward: gather the factor rows of the batch's ids, combine, sum-pool into bags.
Backward (``apply_gradients``, after the base class merged duplicate ids): gather the
factor rows again, run the combine's backward (``_combine_backward``: autograd's ops
for it, written out), and hand each factor's row gradients - duplicates merged - to
that factor's optimizer step. Nothing of size
``num_rows`` is ever materialized (``read_rows`` builds only the rows asked for).

The factors a lookup gathers rows of are stored at ``embedding.row_precision``
(a :class:`LowPrecisionStorage`: decoded to fp32 for the combine, updated in fp32 and
rounded back stochastically); factors used whole (``compression_shapes.WHOLE_FACTORS``: mixed_dim's
projection) stay fp32.

Hot rows (``embedding.hot_fraction``, TT-Rec's cache of frequent rows): ``hot_rows``
virtual rows are also kept exact, as plain rows in ``hot`` (a row storage of its own,
at the row precision), for the ids in ``hot_ids`` (sorted; slots past the ids chosen
hold ids >= ``num_rows``, which no lookup matches)::

    hot_ids [k] int32 sorted (int64 past 2^31 rows)   hot [k, D]
    row i = hot[j] if hot_ids[j] == i else combine(factor rows of i)

``set_hot_ids`` chooses them once, before training, starting each from its current
virtual row; a lookup and an update split the batch's rows between the two.

Checkpoints hold the factors, the hot ids and rows (``factor_state``/
``load_factor_state``), not virtual rows; ``write_rows`` is refused: a virtual row
cannot be set on its own.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from contextlib import contextmanager

import torch
from torch import nn

from recscale.config.schema import QR_OPS
from recscale.embedding.compression_shapes import (
    factor_precision,
    factor_shapes,
    hot_count,
    hot_id_bytes,
    tt_shape,
)
from recscale.embedding.low_precision import device_rows
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import DeviceStorage, RowStorage, merge_duplicate_rows, pool_rows


class DerivedRows(RowStorage):
    """Rows computed from factors (this module, ``compressed_group.py``): ``read_rows``
    builds the rows asked for, which the lookup pools; the update goes through
    ``apply_gradients``. Rows and state cannot be set one by one."""

    derived_rows = True  # rows are computed: init and checkpoints go through the factors

    def lookup(self, rows, offsets, per_sample_weights, for_update=False):
        with serial_if_small(rows.numel() * self.dim, self.device):
            return pool_rows(self.read_rows(rows), offsets, per_sample_weights)

    def apply_pooled_gradients(self, rows, segments, bag_of_id, per_sample_weights, grad_pooled):
        with serial_if_small(rows.numel() * self.dim, self.device):
            super().apply_pooled_gradients(
                rows, segments, bag_of_id, per_sample_weights, grad_pooled
            )

    def track_dirty(self, enabled: bool) -> None:
        self.dirty = None  # checkpoints write the (small) factors whole every time

    def write_rows(self, rows, values):
        # refused, not missing: a virtual row is a product of shared factor rows
        raise TypeError(
            "a compressed table's rows are computed from its factors; write the factors "
            "(load_factor_state) instead"
        )

    def read_state(self, rows):
        return {}

    def write_state(self, rows, state):
        raise TypeError("a compressed table's optimizer state lives in its factors")


class FactoredStorage(DerivedRows):
    """One table's virtual rows from ``factors`` (see the module doc for the layouts)."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        factor_shapes: dict[str, tuple[int, int]],
        optimizer: SparseOptimizer,
        device: torch.device | None = None,
        precision: str = "fp32",
        hot_rows: int = 0,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.num_rows, self.dim, self.precision = num_rows, dim, precision
        # one optimizer object for every factor: the LR schedule sets ``storage.optimizer.lr``
        self.optimizer = optimizer

        def factor(name: str, rows: int, width: int) -> DeviceStorage:
            p = factor_precision(name, precision)
            return device_rows(rows, width, optimizer, p, device, _factor_kernel(kernel, width))

        self.factors = nn.ModuleDict(
            {name: factor(name, rows, width) for name, (rows, width) in factor_shapes.items()}
        )
        self.hot_rows = hot_rows
        if hot_rows:
            self.hot = factor("hot", hot_rows, dim)
            self.register_buffer(
                "hot_ids",
                torch.arange(
                    num_rows,
                    num_rows + hot_rows,
                    dtype=hot_id_dtype(num_rows, hot_rows),
                    device=device,
                ),
            )
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    # -- what a method defines (QRStorage, MixedDimStorage, TTStorage) ---------------
    @abstractmethod
    def _index(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Factor name -> the factor row each virtual row uses (``[N]``)."""

    @abstractmethod
    def _combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Gathered factor rows (``[N, width]`` each; a whole factor for projections) ->
        virtual rows ``[N, dim]``."""

    @abstractmethod
    def _combine_backward(
        self, parts: dict[str, torch.Tensor], grad: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The gradient of ``(combine(parts) * grad).sum()`` for each part, by the ops
        autograd's backward of ``_combine`` runs (the same bits) without its graph: a
        table's update is a few small ops, and the engine's own work was a large share."""

    @abstractmethod
    def init_factors(self, seed: int, feature: int) -> None:
        """Draw the factors so a virtual row has the spread of a plain row's init."""

    # -- the storage interface ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(iter(self.factors.values())).device

    def stored_bytes(self) -> int:
        """Bytes of the weights: factor and hot rows (int8: + their scale and bias) and
        the hot ids - no optimizer state (what the planner's ``weight_bytes`` counts)."""

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        stores = [*self.factors.values(), *([self.hot] if self.hot_rows else [])]
        ids = size(self.hot_ids) if self.hot_rows else 0
        return ids + sum(
            size(f.weight) + (size(f.qparams) if hasattr(f, "qparams") else 0) for f in stores
        )

    def _gather(self, rows: torch.Tensor):
        idx = self._index(rows)
        parts = {}
        for name, f in self.factors.items():
            parts[name] = f.weight if name not in idx else f.read_rows(idx[name])  # fp32
        return idx, parts

    def _computed(self, rows: torch.Tensor) -> torch.Tensor:
        return self._combine(self._gather(rows)[1])

    def _hot_slots(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``rows`` are hot, and their slots in ``hot`` (meaningful where hot)."""
        pos = torch.searchsorted(self.hot_ids, rows.to(self.hot_ids.dtype))
        pos = pos.clamp_(max=self.hot_rows - 1)
        return self.hot_ids[pos] == rows, pos

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.device)
        with torch.no_grad():
            if not self.hot_rows:
                return self._computed(rows)
            hot, pos = self._hot_slots(rows)
            out = torch.empty(rows.shape[0], self.dim, device=rows.device)
            out[~hot] = self._computed(rows[~hot])
            out[hot] = self.hot.read_rows(pos[hot])
            return out

    @torch.no_grad()
    def set_hot_ids(self, ids: torch.Tensor) -> None:
        """Keep the rows of ``ids`` (distinct, at most ``hot_rows``) exact from now on,
        each starting from its current virtual row."""
        ids = torch.unique(ids.to(self.device, torch.int64))
        if ids.numel() > self.hot_rows or (
            ids.numel() and (ids[0] < 0 or ids[-1] >= self.num_rows)
        ):
            raise ValueError(f"hot ids must be at most {self.hot_rows} ids in [0, {self.num_rows})")
        free = torch.arange(
            self.num_rows, self.num_rows + self.hot_rows - ids.numel(), device=ids.device
        )
        self.hot.write_rows(torch.arange(ids.numel(), device=ids.device), self._computed(ids))
        self.hot_ids.copy_(torch.cat([ids, free]).to(self.hot_ids.dtype))

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        """``rows`` unique, ``grad [U, dim]`` their merged gradients: the chain rule to
        each factor's rows, then each factor's own optimizer step."""
        self.step.add_(1)
        if self.hot_rows:
            hot, pos = self._hot_slots(rows)
            if hot.any():
                update_rows(self.hot, pos[hot], grad[hot])
            rows, grad = rows[~hot], grad[~hot]
            if rows.numel() == 0:
                return
        idx, parts = self._gather(rows)
        grads = self._combine_backward(parts, grad)
        for name, f in self.factors.items():
            g = grads[name]
            if name in idx:
                update_rows(f, idx[name], g)
            else:  # a whole factor (a projection): every row, every step
                f.apply_gradients(torch.arange(f.num_rows, device=g.device), g)

    def factor_state(self) -> dict[str, torch.Tensor]:
        """Every factor's rows and optimizer state (and the step), on the CPU."""
        return {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}

    @torch.no_grad()
    def load_factor_state(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)


def update_rows(f: DeviceStorage, rows: torch.Tensor, grad: torch.Tensor) -> None:
    """One optimizer step of factor (or hot-row) storage ``f`` on ``rows`` (repeats
    allowed) with each one's gradient ``grad [N, width]``."""
    if f.backward_kernel() == "native":
        # one C pass: each id's row a bag of its own, duplicates merged on the way
        n = grad.shape[0]
        bags, segments = torch.arange(n), torch.tensor([0, n])  # CPU: where it runs
        f.apply_pooled_gradients(rows, segments, bags, None, grad.contiguous())
    else:
        f.apply_gradients(*merge_duplicate_rows(rows, grad))


def _factor_kernel(requested: str, width: int) -> str:
    """A factor's update: the native fused pass (``model.kernels`` auto or native, a width
    it takes - the kernel then checks the rows' dtype and device), else torch's ops (a
    factor's few hundred rows a step: numba and Triton add a compile for no gain)."""
    return "native" if requested in ("auto", "native") and width % 8 == 0 else "torch"


# A compressed table's step is dozens of small ops (gathers, unique, index_add, bmm on a
# few hundred rows): on the CPU each parallel region costs more in waking the other
# threads (recscale sets OMP_WAIT_POLICY=PASSIVE) than it saves. Measured on the default
# model, every table compressed, 2 cores: TT 7.6k -> 17.7k samples/s, QR 8.9k -> 23.0k,
# mixed_dim 14.9k -> 25.0k. Below this many values (rows x dim), one thread runs them.
_SERIAL_BELOW = 1 << 18


@contextmanager
def serial_if_small(values: int, device: torch.device | None = None):
    threads = torch.get_num_threads()
    on_gpu = device is not None and device.type != "cpu"  # the ops run there, not here
    if on_gpu or values >= _SERIAL_BELOW or threads == 1:
        yield
        return
    torch.set_num_threads(1)  # this thread's parallel regions only (OpenMP's ICV)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _uniform(f: DeviceStorage, lo: float, hi: float, gen: torch.Generator) -> None:
    _set(f, torch.empty(f.weight.shape).uniform_(lo, hi, generator=gen))


def _set(f: DeviceStorage, values: torch.Tensor) -> None:
    """Every row of factor ``f`` from fp32 ``values`` (encoded at the factor's precision)."""
    f.write_rows(torch.arange(f.num_rows, device=f.weight.device), values)


def _generator(seed: int, feature: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + feature * 7919 + 17) % (1 << 63))


class QRStorage(FactoredStorage):
    def __init__(
        self,
        num_rows: int,
        dim: int,
        buckets: int,
        op: str,
        optimizer: SparseOptimizer,
        device: torch.device | None = None,
        precision: str = "fp32",
        hot_rows: int = 0,
        kernel: str = "auto",
    ) -> None:
        if op not in QR_OPS:
            raise ValueError(f"qr op must be one of {QR_OPS}, got {op!r}")
        shapes = factor_shapes("qr", num_rows, dim, qr_buckets=buckets, qr_op=op)
        super().__init__(num_rows, dim, shapes, optimizer, device, precision, hot_rows, kernel)
        self.buckets, self.op = shapes["r"][0], op

    def _index(self, rows):
        return {
            "q": torch.div(rows, self.buckets, rounding_mode="floor"),
            "r": torch.remainder(rows, self.buckets),
        }

    def _combine(self, parts):
        q, r = parts["q"], parts["r"]
        if self.op == "mult":
            return q * r
        return q + r if self.op == "add" else torch.cat([q, r], dim=1)

    def _combine_backward(self, parts, grad):
        q, r = parts["q"], parts["r"]
        if self.op == "mult":
            return {"q": grad * r, "r": grad * q}
        if self.op == "add":
            return {"q": grad, "r": grad}
        return {"q": grad[:, : q.shape[1]], "r": grad[:, q.shape[1] :]}

    @torch.no_grad()
    def init_factors(self, seed: int, feature: int) -> None:
        gen, b = _generator(seed, feature), math.sqrt(1.0 / self.num_rows)
        q, r = self.factors["q"], self.factors["r"]
        if self.op == "mult":  # Q carries the spread, R starts near one
            _uniform(q, -b, b, gen)
            _uniform(r, 0.5, 1.5, gen)
        elif self.op == "add":
            _uniform(q, -b / 2, b / 2, gen)
            _uniform(r, -b / 2, b / 2, gen)
        else:
            _uniform(q, -b, b, gen)
            _uniform(r, -b, b, gen)


class MixedDimStorage(FactoredStorage):
    def __init__(
        self,
        num_rows: int,
        dim: int,
        small_dim: int,
        optimizer: SparseOptimizer,
        device: torch.device | None = None,
        precision: str = "fp32",
        hot_rows: int = 0,
        kernel: str = "auto",
    ) -> None:
        shapes = factor_shapes("mixed_dim", num_rows, dim, small_dim=small_dim)
        super().__init__(num_rows, dim, shapes, optimizer, device, precision, hot_rows, kernel)
        self.small_dim = small_dim

    def _index(self, rows):
        return {"w": rows}  # the projection is used whole

    def _combine(self, parts):
        return parts["w"] @ parts["proj"]

    def _combine_backward(self, parts, grad):
        return {"w": grad @ parts["proj"].t(), "proj": parts["w"].t() @ grad}

    @torch.no_grad()
    def init_factors(self, seed: int, feature: int) -> None:
        gen, b = _generator(seed, feature), math.sqrt(1.0 / self.num_rows)
        _uniform(self.factors["w"], -b, b, gen)
        # N(0, 1/d): a projected row keeps the spread of W's rows
        p = torch.randn(self.small_dim, self.dim, generator=gen) / math.sqrt(self.small_dim)
        _set(self.factors["proj"], p)


class TTStorage(FactoredStorage):
    def __init__(
        self,
        num_rows: int,
        dim: int,
        rank: int,
        optimizer: SparseOptimizer,
        device: torch.device | None = None,
        precision: str = "fp32",
        hot_rows: int = 0,
        kernel: str = "auto",
    ) -> None:
        (n1, n2, n3), (d1, d2, d3) = tt_shape(num_rows, dim)
        shapes = factor_shapes("tt", num_rows, dim, tt_rank=rank)
        super().__init__(num_rows, dim, shapes, optimizer, device, precision, hot_rows, kernel)
        self.n, self.d, self.rank = (n1, n2, n3), (d1, d2, d3), rank

    def _index(self, rows):
        _, n2, n3 = self.n
        return {
            "g1": torch.div(rows, n2 * n3, rounding_mode="floor"),
            "g2": torch.remainder(torch.div(rows, n3, rounding_mode="floor"), n2),
            "g3": torch.remainder(rows, n3),
        }

    def _combine(self, parts):
        (d1, d2, d3), r = self.d, self.rank
        n = parts["g1"].shape[0]
        a = parts["g1"].view(n, d1, r)
        ab = torch.bmm(a, parts["g2"].view(n, r, d2 * r)).view(n, d1 * d2, r)
        return torch.bmm(ab, parts["g3"].view(n, r, d3)).view(n, self.dim)

    def _combine_backward(self, parts, grad):
        """``out = (A B) C`` a row: A ``[d1, R]``, B ``[R, d2 R]``, C ``[R, d3]``, ``A B``
        read as ``[d1 d2, R]``; back: ``d(AB) = dout C^T``, ``dC = (AB)^T dout``, then
        ``dA = d(AB) B^T``, ``dB = A^T d(AB)`` with ``d(AB)`` read as ``[d1, d2 R]``."""
        (d1, d2, d3), r = self.d, self.rank
        n = parts["g1"].shape[0]
        a = parts["g1"].view(n, d1, r)
        b = parts["g2"].view(n, r, d2 * r)
        c = parts["g3"].view(n, r, d3)
        ab = torch.bmm(a, b).view(n, d1 * d2, r)
        go = grad.reshape(n, d1 * d2, d3)
        dab = torch.bmm(go, c.transpose(1, 2)).view(n, d1, d2 * r)
        return {
            "g1": torch.bmm(dab, b.transpose(1, 2)).view(n, d1 * r),
            "g2": torch.bmm(a.transpose(1, 2), dab).view(n, r * d2 * r),
            "g3": torch.bmm(ab.transpose(1, 2), go).view(n, r * d3),
        }

    @torch.no_grad()
    def init_factors(self, seed: int, feature: int) -> None:
        """Gaussian cores whose product has the variance of U(-b, b) (b^2 / 3): an entry
        sums R^2 products of three core entries, so each core gets
        sigma = (b^2 / 3 / R^2) ** (1/6) (TT-Rec's sampled-Gaussian init)."""
        gen, b = _generator(seed, feature), math.sqrt(1.0 / self.num_rows)
        sigma = (b * b / 3 / self.rank**2) ** (1 / 6)
        for f in self.factors.values():
            _set(f, torch.randn(f.weight.shape, generator=gen) * sigma)


def hot_id_dtype(num_rows: int, hot_rows: int) -> torch.dtype:
    """int32 ids (4 bytes a hot row) where the table's ids and the free slots' fit."""
    return torch.int32 if hot_id_bytes(num_rows, hot_rows) == 4 else torch.int64


def build_compressed(
    method: str,
    num_rows: int,
    dim: int,
    small_dim: int,
    cfg,
    optimizer: SparseOptimizer,
    device: torch.device | None,
    kernel: str = "auto",
) -> FactoredStorage:
    """The storage of one compressed table (``cfg``: the ``EmbeddingConfig``; ``kernel``:
    ``model.kernels``)."""
    p, k = cfg.row_precision, hot_count(num_rows, cfg.hot_fraction)
    if method == "qr":
        return QRStorage(num_rows, dim, cfg.qr_buckets, cfg.qr_op, optimizer, device, p, k, kernel)
    if method == "mixed_dim":
        return MixedDimStorage(num_rows, dim, small_dim, optimizer, device, p, k, kernel)
    if method == "tt":
        return TTStorage(num_rows, dim, cfg.tt_rank, optimizer, device, p, k, kernel)
    raise ValueError(f"unknown compression {method!r}")
