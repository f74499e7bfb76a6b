"""Table-batched embedding bags: every table of one dim in one storage, one fused lookup.

Tables are grouped by embedding dim (the common case, all tables of one dim, is a
single group). In a group, table ``t`` owns rows ``[row_offset[t], row_offset[t] +
rows[t])`` of the group's :class:`~recscale.embedding.RowStorage`; an id ``i`` of
feature ``t`` is global row ``row_offset[t] + i``::

    storage.weight  [sum_t rows_t, D]
                     |-- table 0 --|-- table 1 --| ... |-- table F-1 --|

Input is the jagged batch (``values [N]``, ``offsets [F*B+1]``, feature-major);
output is ``pooled [B, sum_f D_f]`` with feature f's vector at columns
``[sum_{g<f} D_g, sum_{g<=f} D_g)`` - for equal dims simply ``view(B, F, D)``.
The backward of the lookup applies the sparse optimizer to the touched rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from recscale.embedding.lookup import (
    native_pool_slots,
    native_pooled_lookup,
    native_rows,
    pooled_lookup,
)
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.sizing import INIT_DRAW_MAX_VALUES
from recscale.embedding.storage import DeviceStorage, RowStorage
from recscale.modules.id_checks import check_ids, explain_failed_lookup
from recscale.modules.table_init import INIT_CHUNK_ROWS, INIT_THREADS, init_table_rows
from recscale.torch_threads import on_torch_threads


@dataclass(frozen=True)
class TableSpec:
    name: str  # the feature it serves, e.g. "C3"
    num_rows: int
    dim: int
    placement: str = "device"  # device memory, or "ssd" (a file behind a hot-row cache)
    cache_bytes: int = 0  # ssd: the table's share of the hot-row cache
    compression: str = "none"  # qr | mixed_dim | tt: rows from factors (embedding/compressed.py)
    small_dim: int = 0  # mixed_dim: the table's own dim before its projection
    kernel: str = ""  # the kernel family the plan chose for its storage ("": the collection's)


@dataclass(frozen=True)
class TablePart:
    """The rectangle of a model table that one table of a collection holds: rows
    ``[row_lo, row_hi)`` x columns ``[col_lo, col_hi)`` of model table ``feature``
    (``kind``: table_wise for a whole table, else the sharding kind that cut it).
    Initial weights are drawn for the rectangle's place in the model table, and
    checkpoints write and read rows by it, so any cut of a table initialises,
    saves and restores to the values the whole table has."""

    feature: int
    kind: str
    row_lo: int
    row_hi: int
    col_lo: int
    col_hi: int
    table_rows: int  # rows of the whole model table (the init's bound depends on it)
    table_dim: int  # its dim (the init draws whole rows, then keeps the part's columns)

    @property
    def num_rows(self) -> int:
        return self.row_hi - self.row_lo

    @property
    def width(self) -> int:
        return self.col_hi - self.col_lo


def _write_drawn_chunks(
    storage: RowStorage, start: int, n: int, dim: int, seed: int, p: TablePart
) -> None:
    """Part ``p``'s initial rows drawn on the CPU a chunk at a time and written at
    storage rows ``[start, start + n)``. In device memory (a GPU, or rows kept as
    fp16 / int8 / split_bf16 halves) the chunks are drawn and written on torch's threads
    at once - each writes its own rows, with no state beside them: config B's
    split_bf16 rows took 52 s one chunk after another. A tier's cache keeps an index,
    so its chunks go in one at a time."""

    def write(lo: int) -> None:
        hi = min(n, lo + INIT_CHUNK_ROWS)
        chunk = torch.empty(hi - lo, dim)
        init_table_rows(
            chunk, seed, p.feature, p.table_rows, p.table_dim,
            p.row_lo + lo, p.row_lo + hi, p.col_lo, p.col_hi,
        )  # fmt: skip
        storage.write_rows(torch.arange(start + lo, start + hi), chunk)

    on_torch_threads(
        write, range(0, n, INIT_CHUNK_ROWS), INIT_THREADS, at_once=storage.tier == "device"
    )


def pooling_weights(
    pooling: str, lengths: torch.Tensor, bag_of_id: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor | None:
    """Per-id weights of the sum the lookup computes: the batch's weights, times
    ``1 / bag length`` for mean pooling."""
    if pooling != "mean":
        return weights
    inv_len = (1.0 / lengths.clamp(min=1).to(torch.float32))[bag_of_id]
    return inv_len if weights is None else weights * inv_len


class _Group(nn.Module):
    def __init__(
        self,
        features: list[int],
        tables: list[TableSpec],
        storage: RowStorage,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        self.dim = tables[features[0]].dim
        self.storage = storage
        offsets = [0]
        for f in features:
            offsets.append(offsets[-1] + tables[f].num_rows)
        self.register_buffer(
            "row_offsets",
            torch.tensor(offsets[:-1], dtype=torch.int64, device=device),
            persistent=False,
        )


def _group_values(
    features: list[int],
    starts: list[int],
    b: int,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    lengths_fb: torch.Tensor,
    bag_of_id: torch.Tensor,
    psw: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A group's ``rows``, ``offsets`` (``[len(features) * b + 1]``), bags (numbered
    within the group: its ``i``-th feature's bags ``i*b .. i*b + b - 1``) and pooling
    weights, from the batch's feature-major ones (``starts[f]``: where feature ``f``'s
    values begin, ``starts[F]`` the end; ``lengths_fb`` ``[F, b]``)."""
    runs: list[tuple[int, int]] = []  # (first feature, feature count) of consecutive runs
    for f in features:
        if runs and runs[-1][0] + runs[-1][1] == f:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((f, 1))
    if len(runs) == 1:  # one slice of each, no copy (a compressed table's group)
        (f, k) = runs[0]
        lo, hi = starts[f], starts[f + k]
        g_psw = None if psw is None else psw[lo:hi]
        return rows[lo:hi], offsets[f * b : (f + k) * b + 1] - lo, bag_of_id[lo:hi] - f * b, g_psw
    spans = []  # (lo, hi, the bag shift) of each run
    i = 0  # the run's first feature's index in the group
    for f, k in runs:
        spans.append((starts[f], starts[f + k], (i - f) * b))
        i += k
    g_lengths = lengths_fb[features].reshape(-1)
    g_offsets = torch.zeros(g_lengths.shape[0] + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(g_lengths, 0, out=g_offsets[1:])
    return (
        torch.cat([rows[lo:hi] for lo, hi, _ in spans]),
        g_offsets,
        torch.cat([bag_of_id[lo:hi] + shift for lo, hi, shift in spans]),
        None if psw is None else torch.cat([psw[lo:hi] for lo, hi, _ in spans]),
    )


class EmbeddingBagCollection(nn.Module):
    def __init__(
        self,
        tables: list[TableSpec],
        pooling: str,
        make_optimizer: Callable[[], SparseOptimizer],
        validate_ids: bool = True,
        device: torch.device | None = None,
        seed: int = 0,
        kernel: str = "auto",
        make_storage: Callable[
            [int, int, SparseOptimizer, list[TableSpec], list[TablePart]], RowStorage
        ]
        | None = None,
        parts: list[TablePart] | None = None,
        init_rows: bool = True,
    ) -> None:
        """Tables are grouped by (dim, placement). ``make_storage(rows, dim, optimizer,
        tables, parts)`` builds a group's storage (default: a :class:`DeviceStorage` on
        ``device``; it is required for tables not placed on the device). ``parts``: which
        rectangle of which model table each table is (default: table i is the whole model
        table i); a collection over shards, or over a subset of a model's tables, says so.
        ``init_rows=False``: a checkpoint is restored next, which writes every row - the
        rows of an in-memory storage are zeroed, not drawn (config B's draw: 8-11 s)."""
        super().__init__()
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be sum or mean, got {pooling!r}")
        self.tables = list(tables)
        self.pooling = pooling
        # Kept so that distributed.shard can build the same storages, shard by shard.
        self.make_optimizer, self.seed, self.kernel = make_optimizer, seed, kernel
        self.init_rows = init_rows
        self.parts = (
            list(parts)
            if parts is not None
            else [
                TablePart(f, "table_wise", 0, t.num_rows, 0, t.dim, t.num_rows, t.dim)
                for f, t in enumerate(tables)
            ]
        )
        self.validate_ids = validate_ids
        # Index buffers live beside the ids they index (the compute device; a model built
        # with its tables on the meta device keeps them on the CPU).
        idx_dev = None if device is None or torch.device(device).type == "meta" else device
        # Zero-size parameter that makes autograd call the fused backward (see embedding/lookup.py).
        self.placeholder = nn.Parameter(torch.zeros(0, device=device))
        self.register_buffer(
            "table_sizes",
            torch.tensor([t.num_rows for t in tables], dtype=torch.int64, device=idx_dev),
            persistent=False,
        )
        # a compressed table is a group of its own (its storage is its factors), but QR
        # tables stack in one where the storages' maker says they do (QRGroupStorage)
        stacks_qr = getattr(make_storage, "stacks_qr", False)
        by_dim: dict[tuple[int, str, str, int], list[int]] = {}
        for f, t in enumerate(tables):
            shares_a_group = t.compression == "none" or (t.compression == "qr" and stacks_qr)
            own = -1 if shares_a_group else f
            by_dim.setdefault((t.dim, t.placement, t.compression, own), []).append(f)
        self.groups = nn.ModuleList()
        group_of_feature = [0] * len(tables)
        local_index = [0] * len(tables)
        for g, ((dim, *_kind), features) in enumerate(sorted(by_dim.items())):
            rows = sum(tables[f].num_rows for f in features)
            storage = (
                make_storage(
                    rows,
                    dim,
                    make_optimizer(),
                    [tables[f] for f in features],
                    [self.parts[f] for f in features],
                )
                if make_storage is not None
                else DeviceStorage(
                    rows, dim, make_optimizer(), device, tables[features[0]].kernel or kernel
                )
            )
            group = _Group(features, tables, storage, idx_dev)
            self._init_weights(group, seed)
            self.groups.append(group)
            for i, f in enumerate(features):
                group_of_feature[f], local_index[f] = g, i
        self.register_buffer(
            "group_of_feature", torch.tensor(group_of_feature, device=idx_dev), persistent=False
        )
        # several groups: where each feature's vector lies among the groups' results laid
        # side by side, for ``_pooled`` to put them in feature order in one gather (empty
        # where that order is the features' own). One dim: feature f's place among the
        # stacked [F, B, D]; several dims: f's columns among the groups' [B, k_g * D_g].
        stacked = [f for g in self.groups for f in g.features]
        one_dim = len({g.dim for g in self.groups}) == 1
        position = [0] * len(tables)
        start, columns = [0] * len(tables), 0
        for i, f in enumerate(stacked):
            position[f], start[f] = i, columns
            columns += tables[f].dim
        index = (
            position
            if one_dim
            else [start[f] + c for f in range(len(tables)) for c in range(tables[f].dim)]
        )
        self.register_buffer(
            "stack_index",
            torch.tensor(index if stacked != sorted(stacked) else [], device=idx_dev)
            if len(self.groups) > 1
            else None,
            persistent=False,
        )
        self.one_dim = one_dim
        # Per-feature row offset into its group's storage.
        row_offset = [
            int(self.groups[group_of_feature[f]].row_offsets[local_index[f]])
            for f in range(len(tables))
        ]
        self.register_buffer(
            "feature_row_offset",
            torch.tensor(row_offset, dtype=torch.int64, device=idx_dev),
            persistent=False,
        )

    @torch.no_grad()
    def _init_weights(self, group: _Group, seed: int) -> None:
        storage = group.storage
        if storage.device.type == "meta":  # a placeholder that distributed/ replaces with shards
            return
        if not self.init_rows and isinstance(storage, DeviceStorage):
            # a restore overwrites them; zeros, never stale memory (the rest of a
            # storage - low halves, int8 grids, optimizer state - is made filled)
            storage.weight.zero_()
            return
        if getattr(storage, "derived_rows", False):  # compressed: drawn as factors
            if getattr(storage, "members", None):  # stacked QR tables: each as alone
                storage.init_factors(seed, [self.parts[f].feature for f in group.features])
            else:
                storage.init_factors(seed, self.parts[group.features[0]].feature)
            return
        start = 0
        for f in group.features:
            n, p = self.tables[f].num_rows, self.parts[f]
            rect = (p.row_lo, p.row_hi, p.col_lo, p.col_hi)
            fp32 = isinstance(storage, DeviceStorage) and storage.weight.dtype == torch.float32
            if fp32 and storage.device.type == "cpu":
                init_table_rows(
                    storage.weight[start : start + n],
                    seed,
                    p.feature,
                    p.table_rows,
                    p.table_dim,
                    *rect,
                )
            elif storage.tier != "device" and n * group.dim <= INIT_DRAW_MAX_VALUES:
                # a tier's file: the part's rows drawn at once and written in file order
                # (scattered writes to a file larger than memory would each read a page)
                weight = torch.empty(n, group.dim)
                init_table_rows(weight, seed, p.feature, p.table_rows, p.table_dim, *rect)
                storage.initialize_segment(start, weight)
            else:  # a GPU, rows kept in another precision, or a tier: a chunk at a time
                _write_drawn_chunks(storage, start, n, group.dim, seed, p)
            start += n

    @property
    def num_features(self) -> int:
        return len(self.tables)

    @property
    def output_dim(self) -> int:
        return sum(t.dim for t in self.tables)

    def storages(self) -> list[RowStorage]:
        return [g.storage for g in self.groups]

    def misplaced(self, compute: torch.device) -> list[str]:
        """One line per tensor of a storage that is not where it belongs when training
        runs on ``compute`` (``RowStorage.misplaced``), named by its tables."""
        out = []
        for g in self.groups:
            names = [self.tables[f].name for f in g.features]
            who = f"table {names[0]}" + (
                f" (its storage holds {len(names)} tables)" if len(names) > 1 else ""
            )
            out += [f"{who}: {m}" for m in g.storage.misplaced(compute)]
        return out

    def tiered(self) -> bool:
        """Whether any table lives behind a cache (host or ssd tier)."""
        return any(g.storage.tier != "device" for g in self.groups)

    def local_parts(self):
        """Each table's ``(TablePart, storage, first storage row)``: checkpoints and tests
        read and write rows through these (see :class:`TablePart`); a table of stacked
        QR tables is its member storage (row 0), which checkpoints as a table alone."""
        for f in range(len(self.tables)):
            group = self.groups[int(self.group_of_feature[f])]
            members = getattr(group.storage, "members", None)
            if members:  # stacked QR tables: each its own storage, of views into the stack
                yield self.parts[f], members[group.features.index(f)], 0
            else:
                yield self.parts[f], group.storage, int(self.feature_row_offset[f])

    def prefetch(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int) -> None:
        """Bring a coming batch's rows into every cached storage ahead of its lookup
        (storages without a slow tier have nothing to do)."""
        groups = [(i, g) for i, g in enumerate(self.groups) if g.storage.tier != "device"]
        if not groups:
            return
        # bags are feature-major: feature f's ids are one run, between these offsets
        per_feature = offsets[::batch_size].diff()
        n = values.shape[0]
        offset = torch.repeat_interleave(self.feature_row_offset, per_feature, output_size=n)
        rows = values + offset
        group = (
            torch.repeat_interleave(self.group_of_feature, per_feature, output_size=n)
            if len(self.groups) > 1
            else None
        )
        try:
            for i, g in groups:
                g.storage.prefetch(rows if group is None else rows[group == i])
        except IndexError as e:  # a tier's row out of bounds
            if not self.validate_ids:
                self._explainer(values, offsets, batch_size)(e)
            raise

    def forward(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Jagged ids -> pooled ``[B, sum_f D_f]`` (see the module docstring for layouts)."""
        pooled = self._pooled(values, offsets, batch_size, weights)
        return pooled.reshape(batch_size, -1) if pooled.dim() == 3 else pooled

    def pooled_by_feature(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        weights: torch.Tensor | None = None,
        bf16: bool = False,
    ) -> torch.Tensor:
        """Pooled ``[B, F, D]`` (all tables of one dim D), without copies where possible:
        the native lookup writes it sample-major (contiguous); the torch path's one-group
        lookup is feature-major, returned as a ``[B, F, D]`` view of ``[F, B, D]`` (strides
        ``(D, B*D, 1)``). The dot interaction reads either layout in place and hands back
        its gradient in the same layout. ``bf16`` (a bf16 consumer): where the native
        lookup runs over the table itself it writes bf16 sums (rounded to nearest even),
        and their gradient comes back in bf16; elsewhere the result is fp32."""
        pooled = self._pooled(values, offsets, batch_size, weights, bf16)
        return pooled if pooled.dim() == 3 else pooled.view(batch_size, self.num_features, -1)

    def _native_pooled(
        self, storage: RowStorage, values, offsets, b: int, weights, bf16: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(pooled [B*F, D] sample-major, rows, bag_of_id)`` by the native pass where
        the storage allows it: over its table, or - training on a cache in host memory -
        rows first, then the cache's slots for them; None otherwise or on an id outside
        its table."""
        table = storage.native_lookup_table()
        if table is not None:
            done = native_pooled_lookup(
                table, values, offsets, b, self.feature_row_offset, self.table_sizes, weights, bf16
            )
            return None if isinstance(done, int) else done
        if not (torch.is_grad_enabled() and self.placeholder.requires_grad):
            return None  # evaluation reads a cached tier's misses without admitting them
        cache = storage.native_slot_table()  # only where the native pass runs
        if cache is None:
            return None
        done = native_rows(values, offsets, b, self.feature_row_offset, self.table_sizes)
        if isinstance(done, int):
            return None
        rows, bag_of_id = done
        slot_ids = storage.slots_for_update(rows)
        pooled = native_pool_slots(cache, slot_ids, offsets, b, self.num_features, weights)
        return pooled, rows, bag_of_id

    def _explainer(self, values, offsets, batch_size) -> Callable[[Exception], None]:
        """With the check off: names the id past its table where a lookup or update
        failed (``explain_failed_lookup``)."""
        return lambda e: explain_failed_lookup(
            e, values, offsets, batch_size, self.table_sizes, self.tables
        )

    def _pooled(self, values, offsets, batch_size, weights, bf16: bool = False) -> torch.Tensor:
        try:
            return self._lookup(values, offsets, batch_size, weights, bf16)
        except (IndexError, RuntimeError) as e:
            if not self.validate_ids:  # name the id, where one is past its table
                self._explainer(values, offsets, batch_size)(e)
            raise

    def _lookup(self, values, offsets, batch_size, weights, bf16: bool = False) -> torch.Tensor:
        """``[B, F, D]`` (tables of one dim; see ``pooled_by_feature``: over several groups
        a view of ``[F, B, D]``) or ``[B, sum_f D_f]``."""
        num_f, b = self.num_features, batch_size
        explain = None if self.validate_ids else self._explainer(values, offsets, b)
        if len(self.groups) == 1 and self.pooling == "sum" and values.device.type == "cpu":
            group = self.groups[0]
            done = self._native_pooled(group.storage, values, offsets, b, weights, bf16)
            if done is not None:  # else the path below runs (and raises on a bad id)
                pooled, rows, bag_of_id = done
                pooled = pooled_lookup(
                    group.storage,
                    self.placeholder,
                    rows,
                    offsets,
                    bag_of_id,
                    offsets[::b],
                    weights,
                    pooled,
                    explain,
                )
                return pooled.view(b, num_f, group.dim)  # sample-major: no copy at all
        lengths = offsets[1:] - offsets[:-1]
        n = values.shape[0]
        bag_of_id = torch.repeat_interleave(
            torch.arange(num_f * b, device=values.device), lengths, output_size=n
        )
        feature_of_value = torch.div(bag_of_id, b, rounding_mode="floor")
        if self.validate_ids:
            check_ids(values, feature_of_value, bag_of_id, b, self.table_sizes, self.tables)
        rows = values + self.feature_row_offset[feature_of_value]
        psw = pooling_weights(self.pooling, lengths, bag_of_id, weights)

        if len(self.groups) == 1:
            group = self.groups[0]
            segments = offsets[::b]  # where each feature's ids start: one segment per table
            pooled = pooled_lookup(
                group.storage,
                self.placeholder,
                rows,
                offsets,
                bag_of_id,
                segments,
                psw,
                None,
                explain,
            )
            return pooled.view(num_f, b, group.dim).transpose(0, 1)

        lengths_fb = lengths.view(num_f, b)
        # Values are feature-major, so a group's are its features' slices: one read of
        # the features' bounds (one device sync), then slices - not a mask over every
        # value for each group (26 compressed tables, each a group: 26 passes a step).
        starts = offsets[::b].tolist()
        outs = []
        for group in self.groups:
            g_rows, g_offsets, g_bag, g_psw = _group_values(
                group.features, starts, b, rows, offsets, lengths_fb, bag_of_id, psw
            )
            pooled = pooled_lookup(
                group.storage,
                self.placeholder,
                g_rows,
                g_offsets,
                g_bag,
                g_offsets[::b],
                g_psw,
                explain=explain,
            )
            outs.append(pooled.view(len(group.features), b, group.dim))
        # the groups' results side by side, then put in feature order by one gather, whose
        # backward is one scatter - a feature picked out of its group (``pooled[i]``) had
        # a backward that zero-filled and added its group's whole gradient per feature
        # (the default model with 10 tables compressed: 1 MB 16 times a step)
        index = self.stack_index
        if self.one_dim:  # [F, B, D], viewed as [B, F, D]
            stacked = torch.cat(outs)
            stacked = stacked.index_select(0, index) if index.numel() else stacked
            return stacked.transpose(0, 1)
        stacked = torch.cat([p.transpose(0, 1).reshape(b, -1) for p in outs], dim=1)
        return stacked.index_select(1, index) if index.numel() else stacked
