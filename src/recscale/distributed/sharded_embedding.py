"""The sharded twin of :class:`~recscale.modules.EmbeddingBagCollection`: three stages.

Same call, same result: ``(values, offsets, B, weights) -> pooled [B, sum_f D_f]``
for this rank's local batch, while the tables live where the plan put them::

    local Batch --input dist--> LocalBatch --compute--> [W*B, X_me] --output dist--> [B, sum D]
                (ids to owners)  (jagged ids   (an Embedding-    (pooled rows back
                                  of my shards) BagCollection     to the samples'
                                                over my shards)   ranks)
      + data_parallel tables: a second collection over full replicas, looked up locally

* input dist (``input_dist.py``): bucketize ids by owning shard, all-to-all; hands the
  compute stage a :class:`LocalBatch` - an ordinary jagged batch whose tables are this
  rank's shards and whose W*B samples are every rank's.
* compute: today's single-device ``EmbeddingBagCollection`` (fused lookup, fused
  sparse-optimizer backward, native / Triton kernels, every storage tier), built over
  the shards: each shard is one of its tables, initialised (and checkpointed) by its
  place in the model table (``TablePart``).
* output dist (``output_dist.py``): all-to-all of pooled vectors back; its backward is
  the reverse all-to-all, after which the compute stage's own backward applies the
  sparse optimizer where the rows live.

World size 1 is the same pipeline with a one-rank plan (``ShardLayout.is_identity``):
both distribution stages hand their input through, and the compute stage *is* the
single-device collection over whole tables - same kernels, same speed.

Replicated (data_parallel) tables all-reduce a dense gradient with a touched-row count
and apply the same update on every rank (``AllReducedStorage``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from recscale.distributed.context import DistContext
from recscale.distributed.input_dist import InputDist, LocalBatch
from recscale.distributed.output_dist import OutputDist
from recscale.embedding.low_precision import LowPrecisionStorage
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import (
    DeviceStorage,
    RowStorage,
    merge_duplicate_rows,
    per_id_gradients,
)
from recscale.modules.embedding_bag_collection import (
    EmbeddingBagCollection,
    TablePart,
    TableSpec,
    pooling_weights,
)
from recscale.modules.id_checks import check_ids
from recscale.planner.layout import ShardLayout

StorageFactory = Callable[[int, int, SparseOptimizer, list[TableSpec], list[TablePart]], RowStorage]


class _AllReduced:
    """A replicated storage: the gradient of every rank's ids is summed across ranks
    before the (identical) update, so replicas stay equal. The all-reduce is dense over
    the storage (``[rows, dim + 1]``, the last column counts touches), which is why only
    small tables are replicated. Mixed into a storage of the run's row precision."""

    always_apply = True  # every rank must join the all-reduce, ids or not
    group: object
    world_size: int

    def takes_bf16_gradients(self) -> bool:
        return False  # its merge below sums in the gradient's dtype: fp32 only

    @torch.no_grad()
    def apply_pooled_gradients(self, rows, segments, bag_of_id, per_sample_weights, grad_pooled):
        grad_ids = per_id_gradients(grad_pooled, bag_of_id, per_sample_weights)
        buf = torch.zeros(self.num_rows, self.dim + 1, device=grad_pooled.device)
        unique, summed = merge_duplicate_rows(rows, grad_ids)  # a fixed order on GPUs too
        buf[unique, : self.dim] = summed
        buf[unique, self.dim] = 1.0  # touched here: only ``> 0`` is read below
        if self.group is not None:
            dist.all_reduce(buf, group=self.group)
        touched = (buf[:, self.dim] > 0).nonzero().squeeze(1)
        if self.dirty is not None:
            self.dirty[touched] = True
        self.apply_gradients(touched, buf[touched, : self.dim] / self.world_size)


class AllReducedStorage(_AllReduced, DeviceStorage):
    """fp32 rows, replicated (:class:`_AllReduced`)."""

    def __init__(self, num_rows, dim, optimizer, device, kernel, group, world_size) -> None:
        super().__init__(num_rows, dim, optimizer, device, kernel)
        self.group, self.world_size = group, world_size


class AllReducedLowPrecisionStorage(_AllReduced, LowPrecisionStorage):
    """Rows at ``embedding.row_precision`` (fp16, bf16, int8, split_bf16), replicated: a
    small table keeps the precision the run asked for at every world size."""

    def __init__(
        self, num_rows, dim, optimizer, precision, device, kernel, group, world_size
    ) -> None:
        super().__init__(num_rows, dim, optimizer, precision, device, kernel)
        self.group, self.world_size = group, world_size


def all_reduced_storage(num_rows, dim, optimizer, precision, device, kernel, group, world_size):
    """A replicated storage at ``precision`` (``embedding.row_precision``; an unresolved
    ``auto`` is fp32, as ``device_rows`` takes it)."""
    if precision in ("fp32", "auto"):
        return AllReducedStorage(num_rows, dim, optimizer, device, kernel, group, world_size)
    return AllReducedLowPrecisionStorage(
        num_rows, dim, optimizer, precision, device, kernel, group, world_size
    )


class _OutputDistFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, pooled, dp_pooled, module, batch_size):
        ctx.module, ctx.batch_size = module, batch_size
        ctx.has_pooled = pooled.requires_grad
        return module.output_dist.forward(pooled, dp_pooled, batch_size, module.ctx.embed)

    @staticmethod
    def backward(ctx, grad_out):
        m = ctx.module
        grad_local, grad_dp = m.output_dist.backward(grad_out, ctx.batch_size, m.ctx.embed)
        return None, (grad_local if ctx.has_pooled else None), grad_dp, None, None


class ShardedEmbeddingBagCollection(nn.Module):
    def __init__(
        self,
        tables: list[TableSpec],
        pooling: str,
        make_optimizer: Callable[[], SparseOptimizer],
        layout: ShardLayout,
        ctx: DistContext,
        seed: int = 0,
        validate_ids: bool = True,
        kernel: str = "auto",
        make_storage: StorageFactory | None = None,
        row_precision: str = "fp32",
        init_rows: bool = True,
    ) -> None:
        """``tables``: the model's tables (a table's ``placement`` and ``cache_bytes``
        carry over to its shards, the cache split by rows). ``make_storage`` builds a
        compute group's storage for host/ssd shards (see ``embedding/placement.py``);
        ``row_precision`` the replicated tables' rows (the shards' come from
        ``make_storage``)."""
        super().__init__()
        self.tables, self.pooling, self.layout, self.ctx = list(tables), pooling, layout, ctx
        self.validate_ids = validate_ids
        self.identity = layout.is_identity
        dev = ctx.device
        self.placeholder = nn.Parameter(torch.zeros(0, device=dev))
        self.register_buffer(
            "table_sizes", torch.tensor([t.num_rows for t in tables], device=dev), persistent=False
        )
        mine = layout.per_rank[ctx.rank].shards
        specs, parts = [], []
        for s in mine:
            t = tables[s.feature]
            name = t.name if self.identity else f"{t.name}.{s.kind}{s.index}"
            cache = t.cache_bytes * s.num_rows // max(t.num_rows, 1)
            if t.compression != "none" and (s.kind != "table_wise" or s.width != t.dim):
                raise ValueError(
                    f"table {t.name} is compressed ({t.compression}): it is placed whole "
                    f"(table_wise), not {s.kind}"
                )
            specs.append(
                TableSpec(
                    name,
                    s.num_rows,
                    s.width,
                    t.placement,
                    cache,
                    t.compression,
                    t.small_dim,
                    t.kernel,
                )
            )
            parts.append(
                TablePart(
                    s.feature, s.kind, s.row_lo, s.row_hi, s.col_lo, s.col_hi, t.num_rows, t.dim
                )
            )
        # The compute stage. Identity: it pools as the model (mean pooling, id checks);
        # else the senders did both, and it sum-pools the weights they sent.
        self.compute = (
            EmbeddingBagCollection(
                specs,
                pooling if self.identity else "sum",
                make_optimizer,
                validate_ids=validate_ids and self.identity,
                device=dev,
                seed=seed,
                kernel=kernel,
                make_storage=make_storage,
                parts=parts,
                init_rows=init_rows,
            )
            if mine
            else None
        )
        self.dp_features = list(layout.dp_features)
        self.dp = None
        if self.dp_features:
            self.dp = EmbeddingBagCollection(
                [tables[f] for f in self.dp_features],
                pooling,
                make_optimizer,
                validate_ids=False,
                device=dev,
                seed=seed,
                kernel=kernel,
                init_rows=init_rows,
                make_storage=lambda n, d, opt, _tables, _parts: all_reduced_storage(
                    n, d, opt, row_precision, dev, kernel, ctx.embed, ctx.world_size
                ),
                parts=[
                    TablePart(
                        f,
                        "data_parallel",
                        0,
                        tables[f].num_rows,
                        0,
                        tables[f].dim,
                        tables[f].num_rows,
                        tables[f].dim,
                    )
                    for f in self.dp_features
                ],
            )
        self.input_dist = InputDist(layout, ctx.rank, dev)
        self.output_dist = OutputDist(layout, ctx.rank, dev)
        self._ready: deque[LocalBatch] = deque()

    @property
    def num_features(self) -> int:
        return len(self.tables)

    @property
    def output_dim(self) -> int:
        return self.output_dist.output_dim

    def collections(self) -> list[EmbeddingBagCollection]:
        return [c for c in (self.compute, self.dp) if c is not None]

    def storages(self) -> list[RowStorage]:
        """Every storage of this rank: the shards' groups, then the replicas'."""
        return [s for c in self.collections() for s in c.storages()]

    def tiered(self) -> bool:
        return any(c.tiered() for c in self.collections())

    def misplaced(self, compute: torch.device) -> list[str]:
        return [m for c in self.collections() for m in c.misplaced(compute)]

    def local_parts(self, include_replicas: bool = True):
        """This rank's pieces of the tables, each ``(TablePart, storage, first storage
        row)``: the owned shards, then (``include_replicas``) every replicated table.
        Checkpoints and tests read and write rows through these."""
        if self.compute is not None:
            yield from self.compute.local_parts()
        if include_replicas and self.dp is not None:
            yield from self.dp.local_parts()

    # -- stage 1: input dist -----------------------------------------------------------
    def distribute_input(self, values, offsets, batch_size, weights=None) -> LocalBatch:
        """Run the input dist for a local batch (the train pipeline calls this ahead, on
        its own thread and process group, then hands the result over with ``enqueue``)."""
        if self.identity:
            return self.input_dist(values, offsets, batch_size, weights, None)
        lengths = offsets[1:] - offsets[:-1]
        bag_of_id = torch.repeat_interleave(
            torch.arange(lengths.shape[0], device=values.device),
            lengths,
            output_size=values.shape[0],
        )
        if self.validate_ids:
            feature = torch.div(bag_of_id, batch_size, rounding_mode="floor")
            check_ids(values, feature, bag_of_id, batch_size, self.table_sizes, self.tables)
        psw = pooling_weights(self.pooling, lengths, bag_of_id, weights)
        return self.input_dist(values, offsets, batch_size, psw, self.ctx.input)

    def prefetch(self, local: LocalBatch) -> None:
        """Make a distributed batch's rows resident in the cached tiers ahead of its lookup."""
        if self.compute is not None and self.compute.tiered():
            self.compute.prefetch(local.values, local.offsets, local.batch_size)

    def enqueue(self, local: LocalBatch) -> None:
        """Hand over a batch already distributed: the forward of the batch whose ``values``
        it was made from takes it (batches arrive in order, so a FIFO)."""
        self._ready.append(local)

    def clear_ready(self) -> None:
        self._ready.clear()
        for s in self.storages():
            s.clear_prefetch()

    def _local_batch(self, values, offsets, batch_size, weights) -> LocalBatch:
        if self._ready and self._ready[0].source is values:
            return self._ready.popleft()
        return self.distribute_input(values, offsets, batch_size, weights)

    # -- stages 2 and 3: compute, output dist --------------------------------------------
    def forward(self, values, offsets, batch_size, weights=None) -> torch.Tensor:
        """``[B, sum_f D_f]`` for this rank's local batch."""
        local = self._local_batch(values, offsets, batch_size, weights)
        if self.identity:
            return self.compute(local.values, local.offsets, local.batch_size, local.weights)
        return self._distributed(local, values, offsets, batch_size, weights)

    def pooled_by_feature(
        self, values, offsets, batch_size, weights=None, bf16: bool = False
    ) -> torch.Tensor:
        """``[B, F, D]`` like the unsharded collection's (the identity layout: its very
        output, without copies, in bf16 where ``bf16`` asks and it can; else a view of
        ``[B, F*D]``, fp32)."""
        local = self._local_batch(values, offsets, batch_size, weights)
        if self.identity:
            return self.compute.pooled_by_feature(
                local.values, local.offsets, local.batch_size, local.weights, bf16
            )
        out = self._distributed(local, values, offsets, batch_size, weights)
        return out.view(batch_size, self.num_features, -1)

    def _distributed(self, local: LocalBatch, values, offsets, b, weights) -> torch.Tensor:
        if self.compute is not None:
            pooled = self.compute(local.values, local.offsets, local.batch_size, local.weights)
        else:
            pooled = torch.zeros(local.batch_size, 0, device=self.ctx.device)
        dp_pooled = None
        if self.dp is not None:
            v, o, w = self._dp_subset(values, offsets, b, weights)
            dp_pooled = self.dp(v, o, b, w)
        if torch.is_grad_enabled() and self.placeholder.requires_grad:
            return _OutputDistFn.apply(self.placeholder, pooled, dp_pooled, self, b)
        return self.output_dist.forward(pooled, dp_pooled, b, self.ctx.embed)

    def _dp_subset(self, values, offsets, b, weights):
        vs, os_, ws, total = [], [offsets.new_zeros(1)], [], 0
        for f in self.dp_features:
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            vs.append(values[lo:hi])
            os_.append(offsets[f * b + 1 : (f + 1) * b + 1] - lo + total)
            if weights is not None:
                ws.append(weights[lo:hi])
            total += hi - lo
        return torch.cat(vs), torch.cat(os_), (torch.cat(ws) if weights is not None else None)
