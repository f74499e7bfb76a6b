"""What a checkpoint holds, captured as an in-memory snapshot and restored from a chain.

``capture`` copies what must be written into host memory (so training can go on
while a background thread writes it); ``write`` puts a snapshot on disk;
``restore`` loads a full checkpoint and then applies each increment in order.

Embedding rows can be stored as ``fp32``, ``fp16`` or ``int8`` (row-wise: per row
``scale = (max - min) / 255`` and ``bias = min``, ``q = round((x - bias) / scale)``,
as Check-N-Run). Optimizer state is always fp32.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale.checkpoint.format import CheckpointError, CheckpointWriter, read_array, verify
from recscale.models.dlrm import DLRM

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class TableSnapshot:
    name: str
    num_rows: int
    dim: int
    rows: np.ndarray | None  # table-local row ids (incremental) or None (all rows)
    weight: np.ndarray  # [n, dim] float32
    state: dict[str, np.ndarray]  # name -> [n, ...] float32


@dataclass
class Snapshot:
    step: int
    kind: str  # full | incremental
    precision: str
    parent: str | None
    tables: list[TableSnapshot]
    dense: bytes
    trainer: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = len(self.dense)
        for t in self.tables:
            n += t.weight.nbytes + sum(s.nbytes for s in t.state.values())
        return n


def _table_views(model: DLRM):
    """(table spec, storage, first row of the table in the storage) per feature."""
    ebc = model.embeddings
    for f, spec in enumerate(ebc.tables):
        group = ebc.groups[int(ebc.group_of_feature[f])]
        yield spec, group.storage, int(ebc.feature_row_offset[f])


def _dense_bytes(model: DLRM, dense_opt: torch.optim.Optimizer) -> bytes:
    buf = io.BytesIO()
    dense_state = {
        k: v.detach().cpu().clone()
        for k, v in model.state_dict().items()
        if not k.startswith("embeddings.")
    }
    steps = [int(g.storage.step) for g in model.embeddings.groups]
    torch.save(
        {"model": dense_state, "optimizer": dense_opt.state_dict(), "storage_steps": steps}, buf
    )
    return buf.getvalue()


def capture(
    model: DLRM, dense_opt: torch.optim.Optimizer, trainer: dict[str, Any], kind: str, precision: str,
    parent: str | None, step: int,
) -> Snapshot:  # fmt: skip
    """Copy the state to host memory. ``incremental`` takes only rows marked dirty."""
    tables = []
    for spec, storage, start in _table_views(model):
        stop = start + spec.num_rows
        if kind == "incremental":
            local = torch.nonzero(storage.dirty[start:stop]).squeeze(1).cpu()
            idx, rows = local + start, local.numpy()
        else:
            idx, rows = torch.arange(start, stop), None
        idx = idx.to(storage.device)
        weight, state = storage.read_rows(idx), storage.read_state(idx)
        tables.append(
            TableSnapshot(
                spec.name,
                spec.num_rows,
                spec.dim,
                rows,
                weight.cpu().numpy(),
                {n: s.cpu().numpy() for n, s in state.items()},
            )  # fmt: skip
        )
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return Snapshot(
        step,
        kind,
        precision,
        parent,
        tables,
        _dense_bytes(model, dense_opt),
        {**trainer, "torch_rng": rng},
    )


def _quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = w.min(axis=1, initial=np.inf), w.max(axis=1, initial=-np.inf)
    if w.shape[0] == 0:
        return np.zeros(w.shape, np.uint8), np.zeros((0, 2), np.float32)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((w - lo[:, None]) / scale[:, None]), 0, 255).astype(np.uint8)
    return q, np.stack([scale, lo], axis=1).astype(np.float32)


def _dequantize_int8(q: np.ndarray, qparams: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * qparams[:, :1] + qparams[:, 1:2]).astype(np.float32)


def write(snap: Snapshot, final_dir: Path) -> Path:
    w = CheckpointWriter(final_dir)
    try:
        tables_meta = []
        for t in snap.tables:
            base = f"tables/{t.name}"
            if t.rows is not None:
                w.write_array(f"{base}.rows.i64", t.rows.astype(np.int64))
            if snap.precision == "fp32":
                w.write_array(f"{base}.weight.f32", t.weight)
            elif snap.precision == "fp16":
                w.write_array(f"{base}.weight.f16", t.weight.astype(np.float16))
            else:
                q, qp = _quantize_int8(t.weight)
                w.write_array(f"{base}.weight.q8", q)
                w.write_array(f"{base}.qparams.f32", qp)
            for name, s in t.state.items():
                w.write_array(f"{base}.state_{name}.f32", s.astype(np.float32))
            tables_meta.append({
                "name": t.name, "num_rows": t.num_rows, "dim": t.dim, "stored_rows": int(t.weight.shape[0]),
                "state": {n: list(s.shape[1:]) for n, s in t.state.items()},
            })  # fmt: skip
        w.write_bytes("dense.pt", snap.dense)
        w.write_bytes("trainer.json", json.dumps(snap.trainer, indent=1).encode())
        return w.finalize({
            "kind": snap.kind, "step": snap.step, "parent": snap.parent, "precision": snap.precision,
            "tables": tables_meta, **snap.meta,
        })  # fmt: skip
    except BaseException:
        w.abort()
        raise


def read_weight(path: Path, name: str, precision: str, n: int, dim: int) -> np.ndarray:
    base = f"tables/{name}"
    if precision == "fp32":
        return read_array(path, f"{base}.weight.f32", np.float32, (n, dim))
    if precision == "fp16":
        return read_array(path, f"{base}.weight.f16", np.float16, (n, dim)).astype(np.float32)
    q = read_array(path, f"{base}.weight.q8", np.uint8, (n, dim))
    return _dequantize_int8(q, read_array(path, f"{base}.qparams.f32", np.float32, (n, 2)))


@torch.no_grad()
def restore(
    model: DLRM, dense_opt: torch.optim.Optimizer | None, chain: list[Path]
) -> dict[str, Any]:
    """Load ``chain`` (a full checkpoint, then increments in order); returns trainer state."""
    views = {spec.name: (spec, storage, start) for spec, storage, start in _table_views(model)}
    trainer: dict[str, Any] = {}
    for path in chain:
        manifest = verify(path)
        for tm in manifest["tables"]:
            if tm["name"] not in views:
                raise CheckpointError(f"{path}: table {tm['name']} is not in the model")
            spec, storage, start = views[tm["name"]]
            if (tm["num_rows"], tm["dim"]) != (spec.num_rows, spec.dim):
                raise CheckpointError(
                    f"{path}: table {tm['name']} is {tm['num_rows']} x {tm['dim']}, the model's is "
                    f"{spec.num_rows} x {spec.dim}"
                )
            n = tm["stored_rows"]
            if manifest["kind"] == "incremental":
                local = read_array(path, f"tables/{tm['name']}.rows.i64", np.int64, (n,))
                idx = torch.from_numpy(local) + start
            else:
                idx = torch.arange(start, start + spec.num_rows)
            weight = read_weight(path, tm["name"], manifest["precision"], n, tm["dim"])
            storage.write_rows(idx, torch.from_numpy(weight))
            state = {
                sname: torch.from_numpy(
                    read_array(
                        path, f"tables/{tm['name']}.state_{sname}.f32", np.float32, (n, *tail)
                    )
                )
                for sname, tail in tm["state"].items()
            }
            storage.write_state(idx, state)
        dense = torch.load(io.BytesIO((path / "dense.pt").read_bytes()), weights_only=False)
        unexpected = model.load_state_dict(dense["model"], strict=False).unexpected_keys
        if unexpected:
            raise CheckpointError(f"{path}: dense state has unknown keys {unexpected[:3]}")
        steps = dense["storage_steps"]
        if len(steps) != len(model.embeddings.groups):  # written by a sharded run: one count
            steps = [max(steps)] * len(model.embeddings.groups)
        for g, s in zip(model.embeddings.groups, steps):
            g.storage.step.fill_(s)
        if dense_opt is not None:
            dense_opt.load_state_dict(dense["optimizer"])
        trainer = json.loads((path / "trainer.json").read_text())
    if "torch_rng" in trainer:
        rng = np.frombuffer(base64.b64decode(trainer["torch_rng"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(rng))
    return trainer
