"""Output dist: pooled shard vectors back to the ranks whose samples they belong to.

The compute stage of rank r pools ``[W*B, X_r]``: its shards' columns side by side
(``X_r`` = the sum of its shard widths), sample-major over (source rank, sample) - so
the B rows meant for rank q are one contiguous block, sent as is::

    rank r sends   pooled[q*B : (q+1)*B, :]          (B * X_r floats) to each rank q
    rank q gets    [B, X_r] from every rank r, and places each shard's columns at the
                   table's columns of the model's [B, sum_f D_f]:
                     table_wise   the whole table          column_wise  its columns
                     row_wise     a partial sum, added

Backward runs the other way: each rank cuts ``grad_out [B, sum_f D_f]`` into the
``[B, X_r]`` blocks of rank r's shards, one all-to-all, and every owner gets the
gradient of its ``[W*B, X_r]`` output, divided by W (each rank's loss is a mean over
its B samples; the model trains on the mean over all W*B, as DDP averages the dense
gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from recscale.planner.layout import ShardLayout


class OutputDist:
    def __init__(self, layout: ShardLayout, rank: int, device: torch.device) -> None:
        self.world, self.rank, self.device = layout.world_size, rank, device
        col = [0]
        for d in layout.dims:
            col.append(col[-1] + d)
        self.col_base, self.output_dim = col[:-1], col[-1]
        # Per source rank: (column in its [B, X_r] block, column in the model's output, width).
        self.blocks: list[list[tuple[int, int, int]]] = []
        self.widths: list[int] = []
        for rs in layout.per_rank:
            cols, x = [], 0
            for s in rs.shards:
                cols.append((x, self.col_base[s.feature] + s.col_lo, s.width))
                x += s.width
            self.blocks.append(cols)
            self.widths.append(x)
        self.my_width = self.widths[rank]
        self.dp_cols = [(self.col_base[f], layout.dims[f]) for f in layout.dp_features]

    def forward(
        self,
        pooled: torch.Tensor,
        dp_pooled: torch.Tensor | None,
        batch_size: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """``pooled [W*B, X_me]`` (+ the replicated tables' ``[B, sum D_dp]``) ->
        the model's ``[B, sum_f D_f]`` for this rank's B samples."""
        b, w = batch_size, self.world
        send = pooled.contiguous().reshape(-1)
        recv_splits = [b * x for x in self.widths]
        if group is not None:
            recv = torch.empty(sum(recv_splits), device=self.device, dtype=pooled.dtype)
            dist.all_to_all_single(recv, send, recv_splits, [b * self.my_width] * w, group=group)
        else:
            recv = send
        out = torch.zeros(b, self.output_dim, device=self.device, dtype=pooled.dtype)
        start = 0
        for cols, x in zip(self.blocks, self.widths):
            block = recv[start : start + b * x].view(b, x)
            start += b * x
            for c_in, c_out, width in cols:
                out[:, c_out : c_out + width] += block[:, c_in : c_in + width]
        if dp_pooled is not None:
            c = 0
            for c_out, d in self.dp_cols:
                out[:, c_out : c_out + d] = dp_pooled[:, c : c + d]
                c += d
        return out

    def backward(
        self, grad_out: torch.Tensor, batch_size: int, group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``grad_out [B, sum_f D_f]`` -> (gradient of this rank's ``[W*B, X_me]``
        output, gradient of the replicated tables' ``[B, sum D_dp]``)."""
        b, w = batch_size, self.world
        blocks = [  # per destination rank r: the [B, X_r] columns of its shards
            torch.cat([grad_out[:, c_out : c_out + width] for _c, c_out, width in cols], 1).reshape(
                -1
            )
            for cols in self.blocks
            if cols
        ]
        send_flat = torch.cat(blocks) if blocks else grad_out.new_zeros(0)
        recv = torch.empty(w * b * self.my_width, device=grad_out.device, dtype=grad_out.dtype)
        if group is not None:
            dist.all_to_all_single(
                recv, send_flat, [b * self.my_width] * w, [b * x for x in self.widths], group=group
            )
        else:
            recv.copy_(send_flat)
        grad_local = recv.view(w * b, self.my_width).div_(w)
        grad_dp = (
            torch.cat([grad_out[:, c : c + d] for c, d in self.dp_cols], 1)
            if self.dp_cols
            else None
        )
        return grad_local, grad_dp
