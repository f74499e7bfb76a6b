"""The sharded twin of :class:`~recscale.modules.EmbeddingBagCollection`.

Same call, same result: ``(values, offsets, B, weights) -> pooled [B, sum_f D_f]``
for this rank's local batch, while the tables live where the plan put them::

    local batch --input dist (all-to-all ids)--> owners: shard lookups (fused storage)
                                                   |
    pooled [B, sum D] <--output dist (all-to-all pooled vectors)--+
        + data_parallel tables: looked up locally from a full replica

Output assembly per shard: table_wise copies, column_wise places its columns,
row_wise adds its partial sum. Backward is the reverse all-to-all of the pooled
gradients, then each owner's fused sparse optimizer on its rows. Gradients are
divided by the world size: each rank's loss is a mean over its B samples, and the
model is trained on the mean over all W*B (as DistributedDataParallel averages the
dense gradients). Replicated tables all-reduce a dense gradient with a touched-row
count and all apply the same update to the rows any rank touched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from recscale.distributed.context import DistContext
from recscale.distributed.input_dist import DistInput, InputDist
from recscale.distributed.layout import Shard, ShardLayout
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import DeviceStorage, per_id_gradients
from recscale.modules.embedding_bag_collection import (
    EmbeddingBagCollection,
    TableSpec,
    check_ids,
    init_table_rows,
    pooling_weights,
)


class AllReducedStorage(DeviceStorage):
    """A replicated storage: the gradient of every rank's ids is summed across ranks
    before the (identical) update, so replicas stay equal. The all-reduce is dense over
    the storage (``[rows, dim + 1]``, the last column counts touches), which is why only
    small tables are replicated."""

    always_apply = True  # every rank must join the all-reduce, ids or not

    def __init__(self, num_rows, dim, optimizer, device, kernel, group, world_size) -> None:
        super().__init__(num_rows, dim, optimizer, device, kernel)
        self.group, self.world_size = group, world_size

    @torch.no_grad()
    def apply_pooled_gradients(self, rows, segments, bag_of_id, per_sample_weights, grad_pooled):
        grad_ids = per_id_gradients(grad_pooled, bag_of_id, per_sample_weights)
        buf = torch.zeros(self.num_rows, self.dim + 1, device=grad_pooled.device)
        buf[:, : self.dim].index_add_(0, rows, grad_ids)
        buf[:, self.dim].index_add_(0, rows, torch.ones_like(rows, dtype=buf.dtype))
        if self.group is not None:
            dist.all_reduce(buf, group=self.group)
        touched = (buf[:, self.dim] > 0).nonzero().squeeze(1)
        if self.dirty is not None:
            self.dirty[touched] = True
        self.apply_gradients(touched, buf[touched, : self.dim] / self.world_size)


class _ShardedPooling(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, dp_pooled, module, inp: DistInput):
        ctx.module, ctx.inp = module, inp
        return module._forward_pooled(inp, dp_pooled)

    @staticmethod
    def backward(ctx, grad_out):
        grad_dp = ctx.module._backward_pooled(ctx.inp, grad_out)
        return None, grad_dp, None, None


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
    ) -> None:
        super().__init__()
        self.tables, self.pooling, self.layout, self.ctx = list(tables), pooling, layout, ctx
        self.validate_ids = validate_ids
        dev = ctx.device
        self.placeholder = nn.Parameter(torch.zeros(0, device=dev))
        self.register_buffer(
            "table_sizes", torch.tensor([t.num_rows for t in tables], device=dev), persistent=False
        )
        col = [0]
        for t in tables:
            col.append(col[-1] + t.dim)
        self.col_base, self.output_dim = col[:-1], col[-1]
        me = layout.per_rank[ctx.rank]
        self.my_shards = me.shards
        self.storages = nn.ModuleList(
            DeviceStorage(n, w, make_optimizer(), dev, kernel)
            for n, w in zip(me.group_rows, me.group_widths)
        )
        for s, g, grow in zip(me.shards, me.group_of, me.group_row):
            weight = self.storages[g].weight
            t = tables[s.feature]
            init_table_rows(weight[grow : grow + s.num_rows], seed, s.feature, t.num_rows, t.dim,
                            s.row_lo, s.row_hi, s.col_lo, s.col_hi)  # fmt: skip
        self.dp_features = list(layout.dp_features)
        self.dp = None
        if self.dp_features:
            self.dp = EmbeddingBagCollection(
                [tables[f] for f in self.dp_features], pooling, make_optimizer,
                validate_ids=False, device=dev, seed=seed, kernel=kernel,
                make_storage=lambda n, d, opt, _tables: AllReducedStorage(
                    n, d, opt, dev, kernel, ctx.embed, ctx.world_size),
                init_ids=self.dp_features,
            )  # fmt: skip
        # Columns of the replicated tables in the local pooled output and in the model's.
        dp_in = [0]
        for f in self.dp_features:
            dp_in.append(dp_in[-1] + tables[f].dim)
        self._dp_cols = [(f, dp_in[i], self.col_base[f], tables[f].dim)
                         for i, f in enumerate(self.dp_features)]  # fmt: skip
        self.input_dist = InputDist(layout, ctx.rank, dev)
        # Where each shard's pooled block lands in the receive buffer (elements per sample).
        self._recv_base = []
        base = 0
        for rs in layout.per_rank:
            for s in rs.shards:
                self._recv_base.append((s, base))
                base += s.width
        self._recv_width = base
        self._send_width = sum(s.width for s in me.shards)
        self._per_rank_width = [sum(s.width for s in rs.shards) for rs in layout.per_rank]
        self._ready: dict[int, DistInput] = {}

    @property
    def num_features(self) -> int:
        return len(self.tables)

    def local_parts(self, include_replicas: bool = True):
        """This rank's pieces of the tables, each ``(shard, storage, first storage row)``:
        the owned shards, then (``include_replicas``) a whole-table pseudo-shard for every
        replicated table. Checkpoints and tests read and write rows through these."""
        me = self.layout.per_rank[self.ctx.rank]
        for s, g, grow in zip(me.shards, me.group_of, me.group_row):
            yield s, self.storages[g], grow
        if include_replicas and self.dp is not None:
            for i, f in enumerate(self.dp_features):
                t = self.tables[f]
                g = self.dp.groups[int(self.dp.group_of_feature[i])]
                s = Shard(-1, f, "data_parallel", self.ctx.rank, 0, t.num_rows, 0, t.dim)
                yield s, g.storage, int(self.dp.feature_row_offset[i])

    # -- input ---------------------------------------------------------------------
    def distribute_input(self, values, offsets, batch_size, weights=None) -> DistInput:
        """Run the input all-to-all for a local batch (the train pipeline calls this ahead,
        on its own thread and process group)."""
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

    def prefetched(self, inp: DistInput) -> None:
        """Register an input already distributed for the batch whose ``values`` it holds."""
        self._ready[id(inp.values)] = inp

    # -- forward / backward ----------------------------------------------------------
    def forward(self, values, offsets, batch_size, weights=None) -> torch.Tensor:
        inp = self._ready.pop(id(values), None)
        if inp is None or inp.values is not values:
            inp = self.distribute_input(values, offsets, batch_size, weights)
        dp_pooled = None
        if self.dp is not None:
            v, o, w = self._dp_subset(values, offsets, batch_size, weights)
            dp_pooled = self.dp(v, o, batch_size, w)
        if torch.is_grad_enabled() and self.placeholder.requires_grad:
            return _ShardedPooling.apply(self.placeholder, dp_pooled, self, inp)
        return self._forward_pooled(inp, dp_pooled)

    def pooled_by_feature(self, values, offsets, batch_size, weights=None) -> torch.Tensor:
        """``[B, F, D]`` like the unsharded collection's (here a view of ``[B, F*D]``)."""
        return self(values, offsets, batch_size, weights).view(batch_size, self.num_features, -1)

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

    def _forward_pooled(self, inp: DistInput, dp_pooled) -> torch.Tensor:
        b, w, dev = inp.batch_size, self.ctx.world_size, self.ctx.device
        parts = []
        with torch.no_grad():
            for storage, g in zip(self.storages, inp.groups):
                pooled = storage.lookup(g.rows, g.offsets, g.weights)  # [S_g * W * B, width]
                parts.append(pooled.view(-1, w, b * storage.dim).transpose(0, 1).reshape(w, -1))
            send = torch.cat(parts, 1).reshape(-1) if parts else torch.zeros(0, device=dev)
            recv = torch.empty(b * self._recv_width, device=dev)
            if self.ctx.embed is not None:
                dist.all_to_all_single(recv, send, [b * x for x in self._per_rank_width],
                                       [b * self._send_width] * w, group=self.ctx.embed)  # fmt: skip
            else:
                recv.copy_(send)
            out = torch.zeros(b, self.output_dim, device=dev)
            for s, base in self._recv_base:
                block = recv[b * base : b * (base + s.width)].view(b, s.width)
                c = self.col_base[s.feature] + s.col_lo
                out[:, c : c + s.width] += block
            if dp_pooled is not None:
                for _f, c_in, c_out, d in self._dp_cols:
                    out[:, c_out : c_out + d] = dp_pooled[:, c_in : c_in + d]
        return out

    @torch.no_grad()
    def _backward_pooled(self, inp: DistInput, grad_out: torch.Tensor):
        b, w, dev = inp.batch_size, self.ctx.world_size, self.ctx.device
        grad_out = grad_out.contiguous()
        pieces = []
        for s, _ in self._recv_base:  # wire order: by owner, then the owner's shard order
            c = self.col_base[s.feature] + s.col_lo
            pieces.append(grad_out[:, c : c + s.width].reshape(-1))
        send = torch.cat(pieces) if pieces else torch.zeros(0, device=dev)
        recv = torch.empty(w * b * self._send_width, device=dev)
        if self.ctx.embed is not None:
            dist.all_to_all_single(recv, send, [b * self._send_width] * w,
                                   [b * x for x in self._per_rank_width], group=self.ctx.embed)  # fmt: skip
        else:
            recv.copy_(send)
        recv = recv.view(w, -1).div_(w)
        start = 0
        for storage, g in zip(self.storages, inp.groups):
            n_shards = g.segments.shape[0] - 1
            width = n_shards * b * storage.dim
            grad = (
                recv[:, start : start + width]
                .reshape(w, n_shards, b, storage.dim)
                .transpose(0, 1)
                .reshape(-1, storage.dim)
            )
            start += width
            if g.rows.numel() > 0:
                storage.apply_pooled_gradients(g.rows, g.segments, g.bag_of_id, g.weights, grad)
            else:  # keep the step count (Adam's bias correction) in line with the unsharded model
                storage.apply_gradients(g.rows, grad[:0])
        if not self.dp_features:
            return None
        return torch.cat(
            [grad_out[:, c_out : c_out + d] for _f, _c_in, c_out, d in self._dp_cols], 1
        )
