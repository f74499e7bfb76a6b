"""Input dist: send every id to the rank whose shard holds its row.

Sender (every rank, its local batch of B samples)::

    id v of feature f  --block-->  the row block holding v (one per table, or one
                                   per row_wise shard)
                       --shards-->  the shard(s) of that block (column_wise: all k)
                       --sort---->  wire order: (owner, owner's shard order), stable,
                                    so ids stay in sample order within a shard
    lengths [S, B]  ids per (shard, sample) in wire order     -> all_to_all_single

    values  [n]     ids local to their shard (v - row_lo)                -> all_to_all_single
    weights [n]     per-id pooling weights (mean pooling, weighted ids), when any

Receiver (the owner of S_me shards) gets, per source rank, its lengths ``[S_me, B]``
and values, and reorders them from (source, shard, sample) to (shard, source,
sample). The result is a :class:`LocalBatch`: an ordinary jagged batch for the
compute stage, whose "tables" are this rank's shards and whose "samples" are the
W*B samples of all ranks (sample ``r*B + b`` is sample b of rank r)::

    bag (shard i, source r, sample b) = i * (W*B) + r*B + b       (feature-major, as Batch)

World size 1 with every table whole (``ShardLayout.is_identity``): the batch passes
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from recscale.planner.layout import ShardLayout


@dataclass
class LocalBatch:
    """The hand-off from input dist to compute: the jagged ids this rank's shards pool,
    bags feature-major over (shard, source rank, sample) - see the module doc."""

    values: torch.Tensor  # [n] ids local to their shard
    offsets: torch.Tensor  # [S_me * W * B + 1]
    batch_size: int  # W * B: the compute stage's "batch"
    weights: torch.Tensor | None  # [n] per-id pooling weights
    source: torch.Tensor  # the local batch's ``values`` it was made from (identity check)


def _all_to_all(out, inp, out_splits, in_splits, group) -> None:
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


class InputDist:
    def __init__(self, layout: ShardLayout, rank: int, device: torch.device) -> None:
        self.layout, self.rank, self.device = layout, rank, device
        self.world = layout.world_size
        nf = len(layout.num_rows)
        self.sharded_features = [f for f in range(nf) if f not in set(layout.dp_features)]
        base = [0]
        for n in layout.num_rows:
            base.append(base[-1] + n)
        # Row blocks in global-row space (feature base + id), each with its shards.
        starts, first, count, keys = [], [], [], []
        for s in layout.shards:
            if s.num_rows == 0:  # a row_wise table with fewer rows than ranks
                continue
            if keys and keys[-1] == (s.feature, s.row_lo):  # another column shard of the block
                count[-1] += 1
            else:
                keys.append((s.feature, s.row_lo))
                starts.append(base[s.feature] + s.row_lo)
                first.append(s.index)
                count.append(1)
        wire = [s.index for rs in layout.per_rank for s in rs.shards]
        wire_pos = [0] * len(layout.shards)
        for pos, idx in enumerate(wire):
            wire_pos[idx] = pos
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        self.feature_base = t(base[:-1])
        self.sharded_mask = torch.zeros(nf, dtype=torch.bool, device=device)
        self.sharded_mask[self.sharded_features] = True
        self.block_starts, self.block_first, self.block_count = t(starts), t(first), t(count)
        self.expand = bool(count) and max(count) > 1
        self.wire_pos = t(wire_pos)
        self.row_shift = t([-s.row_lo for s in layout.shards])
        self.shards_per_rank = [len(rs.shards) for rs in layout.per_rank]
        self.identity = layout.is_identity

    def __call__(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        weights: torch.Tensor | None,
        group: dist.ProcessGroup | None,
    ) -> LocalBatch:
        """``weights``: per-id pooling weights already including mean pooling's 1/len
        (identity layout: the batch's own weights; the compute stage pools as the model)."""
        if self.identity:
            return LocalBatch(values, offsets, batch_size, weights, values)
        b, w, dev = batch_size, self.world, self.device
        batch_values = values
        nf = len(self.layout.num_rows)
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(
            torch.arange(nf * b, device=dev), lengths, output_size=values.shape[0]
        )
        feature = torch.div(bag, b, rounding_mode="floor")
        keep = self.sharded_mask[feature]
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(1)
            values, bag, feature = values[idx], bag[idx], feature[idx]
            weights = None if weights is None else weights[idx]
        grow = self.feature_base[feature] + values
        block = torch.searchsorted(self.block_starts, grow, right=True) - 1
        shard = self.block_first[block]
        if self.expand:  # column_wise: every column shard of the block gets the id
            reps = self.block_count[block]
            src = torch.repeat_interleave(torch.arange(values.shape[0], device=dev), reps)
            starts = torch.cumsum(reps, 0) - reps
            within = torch.arange(src.shape[0], device=dev) - torch.repeat_interleave(starts, reps)
            shard = shard[src] + within
            values, bag = values[src], bag[src]
            weights = None if weights is None else weights[src]
        pos = self.wire_pos[shard]
        order = torch.sort(pos, stable=True).indices
        pos, shard = pos[order], shard[order]
        rows = values[order] + self.row_shift[shard]
        sample = bag[order] - torch.div(bag[order], b, rounding_mode="floor") * b
        send_w = None if weights is None else weights[order]
        num_shards = len(self.layout.shards)
        send_len = torch.bincount(pos * b + sample, minlength=num_shards * b)

        per_rank_ids = send_len.view(num_shards, b).sum(1)
        split_shards = self.shards_per_rank
        counts = torch.stack([c.sum() for c in torch.split(per_rank_ids, split_shards)])
        s_me = split_shards[self.rank]
        recv_len = torch.empty(w * s_me * b, dtype=torch.int64, device=dev)
        if group is None:
            recv_len.copy_(send_len)
            recv_rows, recv_w = rows, send_w
        else:
            _all_to_all(recv_len, send_len, [s_me * b] * w, [n * b for n in split_shards], group)
            in_splits = counts.tolist()
            out_splits = recv_len.view(w, -1).sum(1).tolist()
            recv_rows = torch.empty(sum(out_splits), dtype=torch.int64, device=dev)
            _all_to_all(recv_rows, rows, out_splits, in_splits, group)
            recv_w = None
            # Whether weights travel is a property of the batch, the same on every rank.
            if send_w is not None:
                recv_w = torch.empty(sum(out_splits), dtype=send_w.dtype, device=dev)
                _all_to_all(recv_w, send_w, out_splits, in_splits, group)
        return self._regroup(recv_len, recv_rows, recv_w, s_me, b, batch_values)

    def _regroup(self, recv_len, recv_rows, recv_w, s_me, b, source) -> LocalBatch:
        """(source, shard, sample) -> (shard, source, sample)."""
        w, dev = self.world, self.device
        n_bags = w * s_me * b
        starts = torch.cumsum(recv_len, 0) - recv_len
        perm = torch.arange(n_bags, device=dev).view(w, s_me, b).transpose(0, 1).reshape(-1)
        new_len, new_start = recv_len[perm], starts[perm]
        offsets = torch.zeros(n_bags + 1, dtype=torch.int64, device=dev)
        torch.cumsum(new_len, 0, out=offsets[1:])
        n = recv_rows.shape[0]
        bag_of_id = torch.repeat_interleave(
            torch.arange(n_bags, device=dev), new_len, output_size=n
        )
        gather = new_start[bag_of_id] + torch.arange(n, device=dev) - offsets[bag_of_id]
        wts = None if recv_w is None else recv_w[gather]
        return LocalBatch(recv_rows[gather], offsets, w * b, wts, source)
