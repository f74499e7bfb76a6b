"""Checkpoints of a sharded model, in the same plan-independent format as a single
process writes (``checkpoint/state.py``): one file set per *table*, never per shard.

Save: every rank captures its parts (owned shards; rank 0 also the replicated tables)
- all rows, or for an increment the rows touched since the last checkpoint - and
sends them to rank 0, which assembles whole tables::

    row_wise     parts stacked by rows      column_wise   parts placed side by side
    table_wise   the one part               data_parallel rank 0's replica

and writes them (in the background, like a single-process run). The plan is kept as
metadata only. Restore: every rank reads each table of the chain and keeps the rows
and columns its own parts hold - so a checkpoint from any world size and plan (or
from a single process) loads under any other.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recscale.checkpoint.format import CheckpointError, read_array, verify
from recscale.checkpoint.state import Snapshot, TableSnapshot, read_weight
from recscale.distributed.context import DistContext
from recscale.models.dlrm import DLRM


def all_storages(ebc) -> list:
    """Every storage of a sharded collection: the shard groups, then the replicas."""
    return list(ebc.storages) + ([g.storage for g in ebc.dp.groups] if ebc.dp is not None else [])


def _sharded(model: DLRM):
    ebc = model.embeddings
    if not hasattr(ebc, "local_parts"):
        raise TypeError("expected a model sharded by recscale.distributed.shard")
    return ebc


class ShardedTables:
    """The checkpoint manager's view of a sharded model (see ``LocalTables``)."""

    def __init__(self, model: DLRM, ctx: DistContext) -> None:
        self.model, self.ctx = model, ctx
        self.ebc = _sharded(model)
        self.is_writer = ctx.is_main

    def storages(self) -> list:
        return all_storages(self.ebc)

    def global_sum(self, x: int) -> int:
        t = torch.tensor([x], dtype=torch.int64, device=self.ctx.device)  # NCCL: on the GPU
        dist.all_reduce(t, group=self.ctx.dense)
        return int(t[0])

    def _local_parts(self, kind: str) -> list[tuple[Any, np.ndarray | None, np.ndarray, dict]]:
        parts = []
        for s, storage, first in self.ebc.local_parts(include_replicas=self.ctx.is_main):
            if kind == "incremental":
                local = torch.nonzero(storage.dirty[first : first + s.num_rows]).squeeze(1)
                idx, rows = local + first, local.cpu().numpy()
            else:
                idx, rows = torch.arange(first, first + s.num_rows), None
            idx = idx.to(storage.device)
            state = {n: v.cpu().numpy() for n, v in storage.read_state(idx).items()}
            parts.append((s, rows, storage.read_rows(idx).cpu().numpy(), state))
        return parts

    def capture(self, dense_opt, trainer, kind, precision, parent, step) -> Snapshot | None:
        parts = self._local_parts(kind)
        gathered = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(parts, gathered, dst=0, group=self.ctx.dense)
        if not self.ctx.is_main:
            return None
        tables = assemble_tables(self.ebc.tables, [p for rank in gathered for p in rank])
        steps = [int(s.step) for s in self.storages()]
        buf = io.BytesIO()
        dense_state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()
                       if not k.startswith("embeddings.")}  # fmt: skip
        torch.save({"model": dense_state, "optimizer": dense_opt.state_dict(),
                    "storage_steps": [max(steps)]}, buf)  # fmt: skip
        return Snapshot(step, kind, precision, parent, tables, buf.getvalue(), dict(trainer))


def assemble_tables(specs, parts) -> list[TableSnapshot]:
    """Whole tables (or, for increments, their touched rows) from shard parts."""
    by_feature: dict[int, list] = {}
    for p in parts:
        by_feature.setdefault(p[0].feature, []).append(p)
    out = []
    for f, spec in enumerate(specs):
        mine = sorted(by_feature.get(f, []), key=lambda p: (p[0].row_lo, p[0].col_lo))
        if not mine:
            raise CheckpointError(f"no rank sent table {spec.name}")
        incremental = mine[0][1] is not None
        blocks: dict[int, list] = {}  # row_lo -> its column parts
        for p in mine:
            blocks.setdefault(p[0].row_lo, []).append(p)
        rows_out, weights, states = [], [], []
        for row_lo in sorted(blocks):
            cols = blocks[row_lo]
            s0, rows, w0, st0 = cols[0]
            n = w0.shape[0]
            weight = np.empty((n, spec.dim), np.float32)
            state = {k: np.empty((n, *((spec.dim,) if v.ndim == 2 else ())), np.float32)
                     for k, v in st0.items()}  # fmt: skip
            for s, _rows, w, st in cols:
                weight[:, s.col_lo : s.col_hi] = w
                for k, v in st.items():
                    # Row-wise state of column shards: per shard; the first shard's is kept.
                    if v.ndim == 2:
                        state[k][:, s.col_lo : s.col_hi] = v
                    elif s is s0:
                        state[k][:] = v
            rows_out.append((rows if incremental else np.arange(n)) + s0.row_lo)
            weights.append(weight)
            states.append(state)
        names = states[0].keys() if states else []
        out.append(TableSnapshot(
            spec.name, spec.num_rows, spec.dim,
            np.concatenate(rows_out).astype(np.int64) if incremental else None,
            np.concatenate(weights) if weights else np.zeros((0, spec.dim), np.float32),
            {k: np.concatenate([st[k] for st in states]) for k in names},
        ))  # fmt: skip
    return out


@torch.no_grad()
def restore_sharded(model: DLRM, dense_opt, chain: list[Path]) -> dict[str, Any]:
    """Load a checkpoint chain (written at any world size, under any plan) into this
    rank's parts; returns the trainer state."""
    ebc = _sharded(model)
    parts: dict[str, list] = {}
    for s, storage, first in ebc.local_parts():
        parts.setdefault(ebc.tables[s.feature].name, []).append((s, storage, first))
    specs = {t.name: t for t in ebc.tables}
    trainer: dict[str, Any] = {}
    for path in chain:
        manifest = verify(path)
        for tm in manifest["tables"]:
            spec = specs.get(tm["name"])
            if spec is None or (tm["num_rows"], tm["dim"]) != (spec.num_rows, spec.dim):
                raise CheckpointError(f"{path}: table {tm['name']} does not match the model")
            n = tm["stored_rows"]
            if manifest["kind"] == "incremental":
                idx = torch.from_numpy(
                    read_array(path, f"tables/{tm['name']}.rows.i64", np.int64, (n,))
                )
            else:
                idx = torch.arange(spec.num_rows)
            weight = torch.from_numpy(
                read_weight(path, tm["name"], manifest["precision"], n, tm["dim"])
            )
            state = {k: torch.from_numpy(read_array(path, f"tables/{tm['name']}.state_{k}.f32",
                                                    np.float32, (n, *tail)))
                     for k, tail in tm["state"].items()}  # fmt: skip
            for s, storage, first in parts.get(tm["name"], []):
                sel = ((idx >= s.row_lo) & (idx < s.row_hi)).nonzero().squeeze(1)
                rows = idx[sel] - s.row_lo + first
                storage.write_rows(rows, weight[sel][:, s.col_lo : s.col_hi])
                storage.write_state(rows, {k: (v[sel][:, s.col_lo : s.col_hi] if v.dim() == 2 else v[sel])
                                           for k, v in state.items()})  # fmt: skip
        dense = torch.load(io.BytesIO((path / "dense.pt").read_bytes()), weights_only=False)
        unexpected = model.load_state_dict(dense["model"], strict=False).unexpected_keys
        if unexpected:
            raise CheckpointError(f"{path}: dense state has unknown keys {unexpected[:3]}")
        step = max(dense["storage_steps"])
        for storage in all_storages(ebc):
            storage.step.fill_(step)
        if dense_opt is not None:
            dense_opt.load_state_dict(dense["optimizer"])
        trainer = json.loads((path / "trainer.json").read_text())
    return trainer
