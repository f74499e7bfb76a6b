"""What a checkpoint holds, captured per rank and restored from a chain, at any world size.

Tables are read and written through the collection's ``local_parts()``: each is a
``(TablePart, storage, first storage row)`` - a whole table in a single process, a
shard (or a replica) in a sharded run. The same code runs in both:

* ``capture`` copies this rank's parts (all rows, or for an increment the rows touched
  since the last checkpoint) to host memory, so training can go on while a background
  thread writes them; parts on a host/ssd tier - and every part when the write is
  synchronous (``stream``: the final save, ``async_write = false``, or a copy the host
  memory cannot hold) - are not copied but *streamed* from the storage in chunks when
  written (the manager then writes synchronously);
* ``write_part`` writes one rank's snapshot into the checkpoint's temporary directory;
  rank 0 also writes ``dense.pt`` + ``trainer.json`` and assembles the manifest
  (``format.CheckpointWriter.finalize``);
* ``restore`` loads a full checkpoint and then each increment in order: every rank reads
  the overlap of each stored part with each of its own parts (in chunks, ``stored_rows.py``),
  so a checkpoint written under any plan loads under any other.

Embedding rows can be stored as ``fp32``, ``fp16`` or ``int8`` (row-wise: per row
``scale = (max - min) / 255`` and ``bias = min``, ``q = round((x - bias) / scale)``,
as Check-N-Run). Optimizer state is always fp32. Row-wise state (one value per row)
of a column-split table is kept per column part; a restore takes it from the stored
part that holds the restored part's first column.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from recscale.checkpoint.format import (
    CheckpointError,
    CheckpointWriter,
    checked_file,
    read_array,
    verify,
)
from recscale.checkpoint.stored_rows import (
    check_finite,
    check_stored_rows,
    quantize_int8,
    read_weight,
    stored_array_rows,
)
from recscale.checkpoint.trainer_files import load_dense, trainer_state
from recscale.config.schema import CHECKPOINT_PRECISIONS as PRECISIONS
from recscale.embedding.storage import RowStorage
from recscale.modules.embedding_bag_collection import TablePart, TableSpec

__all__ = [
    "PRECISIONS",
    "PartSnapshot",
    "Snapshot",
    "TableSource",
    "capture",
    "restore",
    "write_part",
]


class TableSource(Protocol):
    """What checkpoints read and write: an embedding collection - single-device or its
    sharded twin - and the parts of the model's tables this process holds."""

    tables: list[TableSpec]  # the model's tables (a part's ``feature`` indexes them)

    def local_parts(self) -> Iterable[tuple[TablePart, RowStorage, int]]: ...

    def storages(self) -> list[RowStorage]: ...


class Checkpointable(Protocol):
    """A model whose ``embeddings`` is a :class:`TableSource` (``DLRM``, sharded or not)."""

    embeddings: TableSource

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> Any: ...


_CHUNK_ROWS = 1 << 16
ROW_GRID_STATE = {"qscale", "qbias"}


@dataclass
class PartSnapshot:
    name: str  # the table's name
    num_rows: int  # the whole table's
    dim: int  # the whole table's
    part: TablePart  # the rectangle held
    rows: np.ndarray | None  # table row ids (incremental), or None (every row of the part)
    weight: np.ndarray | None  # [n, width] float32; None: streamed from ``storage``
    state: dict[str, np.ndarray]  # name -> [n, ...] float32 (streamed: empty)
    storage: RowStorage | None = None  # streamed parts: read at write time
    first: int = 0  # streamed parts: the part's first row in ``storage``

    @property
    def streamed(self) -> bool:
        return self.weight is None

    @property
    def stored_rows(self) -> int:
        """Rows this part's files hold: the increment's, or every row of the part."""
        return self.part.num_rows if self.rows is None else len(self.rows)


@dataclass
class Snapshot:
    step: int
    kind: str  # full | incremental
    precision: str
    parent: str | None
    rank: int
    parts: list[PartSnapshot]
    table_order: list[str]
    dense: bytes | None  # rank 0 only
    trainer: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    # compressed tables (embedding/compressed.py): name -> the factors' state, whole in
    # every checkpoint (they are small) - parts/rankNNNNN/factors.pt
    factors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = len(self.dense or b"")
        for p in self.parts:
            if not p.streamed:
                n += p.weight.nbytes + sum(s.nbytes for s in p.state.values())
        return n

    @property
    def streamed(self) -> bool:
        return any(p.streamed for p in self.parts)


def _dense_bytes(
    model: Checkpointable, dense_opt: torch.optim.Optimizer, embedding_step: int
) -> bytes:
    buf = io.BytesIO()
    dense_state = {
        k: v.detach().cpu().clone()
        for k, v in model.state_dict().items()
        if not k.startswith("embeddings.")
    }
    torch.save(
        {
            "model": dense_state,
            "optimizer": dense_opt.state_dict(),
            "embedding_step": embedding_step,
        },
        buf,
    )
    return buf.getvalue()


def _written_parts(ebc: TableSource, rank: int) -> Iterator[tuple[TablePart, RowStorage, int]]:
    """The parts of ``ebc.local_parts()`` this rank writes: replicated parts on rank 0
    alone, and none without rows (a row-wise shard of a table smaller than the world)."""
    for p, storage, first in ebc.local_parts():
        if (p.kind != "data_parallel" or rank == 0) and p.num_rows > 0:
            yield p, storage, first


def copy_bytes(model: Checkpointable, kind: str, rank: int = 0) -> int:
    """Host bytes :func:`capture` copies without ``stream``: fp32 rows and per-row state,
    every row of a device-tier part, or an increment's dirty rows of any part."""
    total = 0
    for p, storage, first in _written_parts(model.embeddings, rank):
        if storage.derived_rows:  # factors, not rows
            continue
        if kind == "incremental":
            rows = int(storage.dirty[first : first + p.num_rows].sum())
        elif storage.tier == "device":
            rows = p.num_rows
        else:
            continue
        one = torch.tensor([first], device=storage.device)
        per_row = storage.read_rows(one)[0].numel()
        per_row += sum(t[0].numel() for t in storage.read_state(one).values())
        total += 4 * rows * per_row
    return total


def capture(
    model: Checkpointable,
    dense_opt: torch.optim.Optimizer,
    trainer: dict[str, Any],
    kind: str,
    precision: str,
    parent: str | None,
    step: int,
    rank: int = 0,
    stream: bool = False,
) -> Snapshot:
    """Copy this rank's state to host memory (see the module doc). ``incremental`` takes
    only rows marked dirty. ``stream``: copy no rows, every part is read from its storage
    as it is written (a synchronous write: the manager's)."""
    ebc = model.embeddings
    parts = []
    factors = {}
    for p, storage, first in _written_parts(ebc, rank):
        spec = ebc.tables[p.feature]  # the model's table (p.feature indexes the model's)
        name, table_rows, dim = spec.name, spec.num_rows, spec.dim
        if storage.derived_rows:  # a compressed table: its factors, not its rows
            factors[name] = storage.factor_state()
            continue
        if kind == "incremental":
            local = torch.nonzero(storage.dirty[first : first + p.num_rows]).squeeze(1).cpu()
            rows = (local + p.row_lo).numpy()
            if stream:
                parts.append(PartSnapshot(name, table_rows, dim, p, rows, None, {}, storage, first))
                continue
            idx = (local + first).to(storage.device)
        elif storage.tier != "device" or stream:
            parts.append(PartSnapshot(name, table_rows, dim, p, None, None, {}, storage, first))
            continue
        else:
            idx, rows = torch.arange(first, first + p.num_rows, device=storage.device), None
        weight, state = storage.read_rows(idx), storage.read_state(idx)
        parts.append(
            PartSnapshot(
                name,
                table_rows,
                dim,
                p,
                rows,
                weight.cpu().numpy(),
                {n: s.cpu().numpy() for n, s in state.items()},
            )
        )
    steps = [int(s.step) for s in ebc.storages()]
    dense = _dense_bytes(model, dense_opt, max(steps, default=0)) if rank == 0 else None
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    order = [t.name for t in ebc.tables]
    return Snapshot(
        step,
        kind,
        precision,
        parent,
        rank,
        parts,
        order,
        dense,
        {**trainer, "torch_rng": rng},
        factors=factors,
    )


def _part_prefix(rank: int, name: str, p) -> str:
    return f"parts/rank{rank:05d}/{name}.r{p.row_lo}-{p.row_hi}.c{p.col_lo}-{p.col_hi}"


def _streamed(ps: PartSnapshot, what: str, precision: str) -> Iterator[np.ndarray]:
    """One file of a streamed part, chunk by chunk (``what``: ``weight.f32`` ... or
    ``state_NAME``): every row of the part, or an increment's ``ps.rows``."""
    tiered = ps.storage.tier != "device"  # as ever: a tier's reads take CPU row indices
    device = torch.device("cpu") if tiered else ps.storage.device
    for lo in range(0, ps.stored_rows, _CHUNK_ROWS):
        hi = min(ps.stored_rows, lo + _CHUNK_ROWS)
        if ps.rows is None:
            idx = torch.arange(ps.first + lo, ps.first + hi, device=device)
        else:
            idx = torch.from_numpy(ps.rows[lo:hi] - ps.part.row_lo + ps.first).to(device)
        if what.startswith("state_"):
            yield ps.storage.read_state(idx)[what[6:]].cpu().numpy().astype(np.float32)
            continue
        files = dict(_weight_files(precision, "", ps.storage.read_rows(idx).cpu().numpy()))
        yield files["." + what]


def _weight_files(precision: str, base: str, weight: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if precision == "fp32":
        return [(f"{base}.weight.f32", weight.astype(np.float32, copy=False))]
    if precision == "fp16":
        return [(f"{base}.weight.f16", weight.astype(np.float16))]
    q, qp = quantize_int8(weight)
    return [(f"{base}.weight.q8", q), (f"{base}.qparams.f32", qp)]


def write_part(snap: Snapshot, w: CheckpointWriter) -> None:
    """This rank's parts (and, on rank 0, the dense state) into the temporary directory."""
    tables = []
    for ps in snap.parts:
        p = ps.part
        base = _part_prefix(snap.rank, ps.name, p)
        if ps.rows is not None:
            w.write_array(f"{base}.rows.i64", ps.rows.astype(np.int64))
        if ps.streamed:  # a host/ssd tier: chunk by chunk, never the whole part in memory
            shapes = ps.storage.optimizer.state_shapes(p.width)
            for n, _ in _weight_files(snap.precision, "", np.zeros((0, 1), np.float32)):
                w.write_chunks(base + n, _streamed(ps, n[1:], snap.precision))
            for sname in shapes:
                w.write_chunks(
                    f"{base}.state_{sname}.f32", _streamed(ps, f"state_{sname}", snap.precision)
                )
            state_tails = {sname: list(shape) for sname, shape in shapes.items()}
            stored = ps.stored_rows
        else:
            for n, arr in _weight_files(snap.precision, base, ps.weight):
                w.write_array(n, arr)
            for s, arr in ps.state.items():
                w.write_array(f"{base}.state_{s}.f32", arr.astype(np.float32))
            state_tails = {s: list(arr.shape[1:]) for s, arr in ps.state.items()}
            stored = int(ps.weight.shape[0])
        tables.append(
            {
                "name": ps.name,
                "table": {
                    "name": ps.name,
                    "num_rows": ps.num_rows,
                    "dim": ps.dim,
                    "state": state_tails,
                },
                "part": {
                    "prefix": base,
                    "kind": p.kind,
                    "row_lo": p.row_lo,
                    "row_hi": p.row_hi,
                    "col_lo": p.col_lo,
                    "col_hi": p.col_hi,
                    "stored_rows": stored,
                    "state": state_tails,
                },
            }
        )
    if snap.factors:
        buf = io.BytesIO()
        torch.save(snap.factors, buf)
        w.write_bytes(f"parts/rank{snap.rank:05d}/factors.pt", buf.getvalue())
    if snap.dense is not None:
        w.write_bytes("dense.pt", snap.dense)
        w.write_bytes("trainer.json", json.dumps(snap.trainer, indent=1).encode())
    w.commit_part(tables)


# -- restore ----------------------------------------------------------------------------


# what differs when a checkpoint's dense weights do not fit the model
_ARCH = (
    ": the model's dense layers differ from the checkpoint's (resume with the "
    "model.bottom_mlp, top_mlp, interaction and num_dense_features it was written with)"
)


def _load_dense_weights(path: Path, model: Checkpointable, dense: Any) -> None:
    """``dense.pt``'s MLP weights into ``model``, checked first: a dict holding every dense
    tensor of the model (everything but ``embeddings.*``, as ``_dense_bytes`` writes it)
    at its shape, finite, and nothing else. An empty one had left the model's initial
    weights without a word; other shapes were tracebacks; NaN weights trained on behind
    fused ReLUs (which map NaN to 0) with a dead layer."""
    weights = dense.get("model") if isinstance(dense, dict) else None
    if not isinstance(weights, dict):
        raise CheckpointError(f"{path}: dense.pt holds no dense weights ({type(dense).__name__})")
    own = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise CheckpointError(f"{path}: dense state has unknown keys {unknown[:3]}{_ARCH}")
    missing = sorted(set(own) - set(weights))
    if missing:
        raise CheckpointError(f"{path}: dense state lacks {missing[:3]}{_ARCH}")
    for k, v in weights.items():
        if not isinstance(v, torch.Tensor) or v.shape != own[k].shape:
            what = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckpointError(
                f"{path}: {k} is {what}, the model's {tuple(own[k].shape)}{_ARCH}"
            )
        check_finite(v, path, k)
    model.load_state_dict(weights, strict=False)


def _stored_parts(tm: dict[str, Any]) -> list[dict[str, Any]]:
    """A table's stored parts; a version-1 checkpoint's table is one whole part."""
    if "parts" in tm:
        return tm["parts"]
    return [
        {
            "prefix": f"tables/{tm['name']}",
            "row_lo": 0,
            "row_hi": tm["num_rows"],
            "col_lo": 0,
            "col_hi": tm["dim"],
            "stored_rows": tm["stored_rows"],
            "state": tm["state"],
        }
    ]


def _apply_stored_part(path: Path, precision: str, incremental: bool, sp: dict, mine) -> None:
    """Copy the overlap of stored part ``sp`` into each of this rank's ``mine`` parts."""
    n, width = sp["stored_rows"], sp["col_hi"] - sp["col_lo"]
    base = sp["prefix"]
    if incremental:
        stored_rows = np.array(read_array(path, f"{base}.rows.i64", np.int64, (n,)))
        check_stored_rows(stored_rows, sp["row_lo"], sp["row_hi"], path, f"{base}.rows.i64")
    for p, storage, first in mine:
        c0, c1 = max(p.col_lo, sp["col_lo"]), min(p.col_hi, sp["col_hi"])
        r0, r1 = max(p.row_lo, sp["row_lo"]), min(p.row_hi, sp["row_hi"])
        if c0 >= c1 or r0 >= r1:
            continue
        if incremental:
            positions = np.nonzero((stored_rows >= r0) & (stored_rows < r1))[0]
            chunks = [positions[i : i + _CHUNK_ROWS] for i in range(0, len(positions), _CHUNK_ROWS)]
            rows_of = lambda sel: stored_rows[sel]  # noqa: E731
        else:
            lo = r0 - sp["row_lo"]
            chunks = [
                slice(a, min(r1 - sp["row_lo"], a + _CHUNK_ROWS))
                for a in range(lo, r1 - sp["row_lo"], _CHUNK_ROWS)
            ]
            rows_of = lambda sel: np.arange(sel.start, sel.stop) + sp["row_lo"]  # noqa: E731
        whole_cols = (c0, c1) == (p.col_lo, p.col_hi)
        first_col_here = sp["col_lo"] <= p.col_lo < sp["col_hi"]
        for sel in chunks:
            table_rows = rows_of(sel)
            if len(table_rows) == 0:
                continue
            idx = torch.from_numpy(table_rows - p.row_lo + first).to(storage.device)
            weight = torch.from_numpy(
                read_weight(path, base, precision, n, width, sel)[
                    :, c0 - sp["col_lo"] : c1 - sp["col_lo"]
                ]
            )
            check_finite(weight, path, base)
            if not whole_cols:  # patch some columns of the rows it holds
                full = storage.read_rows(idx).cpu()
                full[:, c0 - p.col_lo : c1 - p.col_lo] = weight
                weight = full
            storage.write_rows(idx, weight)
            state = {}
            current = storage.read_state(idx) if not whole_cols else None
            for sname, tail in sp["state"].items():
                arr = torch.from_numpy(
                    stored_array_rows(
                        path, f"{base}.state_{sname}.f32", np.float32, (n, *tail), sel
                    )
                )
                check_finite(arr, path, f"{base} ({sname})")
                if arr.dim() == 2:  # element-wise state: the same columns as the weight
                    arr = arr[:, c0 - sp["col_lo"] : c1 - sp["col_lo"]]
                    if not whole_cols:
                        cur = current[sname].cpu()
                        cur[:, c0 - p.col_lo : c1 - p.col_lo] = arr
                        arr = cur
                elif not first_col_here:  # row-wise state: from the part of our first column
                    arr = current.get(sname) if current is not None else None
                    arr = arr.cpu() if arr is not None else None
                if arr is not None:
                    state[sname] = arr
            if state:
                storage.write_state(idx, state)


def _load_factors(path: Path, derived: dict[str, RowStorage], plain: set[str]) -> set[str]:
    """Load the factors of this process's compressed tables from every rank's
    ``factors.pt`` of checkpoint ``path`` (a table may have lived on any rank); returns
    the names found. A table stored as factors that the model keeps as rows is an error."""
    found = set()
    for f in sorted(path.glob("parts/rank*/factors.pt")):
        f = checked_file(path, str(f.relative_to(path)))
        try:
            saved = torch.load(io.BytesIO(f.read_bytes()), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - the unpickler's errors vary by payload
            raise CheckpointError(f"{f}: not a plain tensor file, refused to load it") from e
        if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
            raise CheckpointError(f"{f}: not a table -> factor state mapping")
        for name, state in saved.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    check_finite(value, f, f"the factors of {name} ({key})")
            found.add(name)
            if name in plain:
                raise CheckpointError(
                    f"{path}: table {name} is stored compressed (as factors), the model keeps "
                    "its rows: resume with the embedding.compression it was written with"
                )
            if name in derived:
                try:
                    derived[name].load_factor_state(state)
                except (RuntimeError, TypeError, KeyError) as e:
                    raise CheckpointError(
                        f"{f}: the factors of {name} do not fit the model's "
                        "(embedding.compression, "
                        "qr_buckets, tt_rank, md_alpha and hot_fraction must match the run's): "
                        f"{str(e)[:200]}"
                    ) from e
    return found


@torch.no_grad()
def restore(
    model: Checkpointable, dense_opt: torch.optim.Optimizer | None, chain: list[Path]
) -> dict[str, Any]:
    """Load ``chain`` (a full checkpoint, then increments in order) into the parts this
    process holds - a whole model, or this rank's shards; returns the trainer state."""
    ebc = model.embeddings
    mine_by_name: dict[str, list] = {}
    for p, storage, first in ebc.local_parts():
        mine_by_name.setdefault(ebc.tables[p.feature].name, []).append((p, storage, first))
    specs = {t.name: t for t in ebc.tables}
    derived = {n: m[0][1] for n, m in mine_by_name.items() if m[0][1].derived_rows}
    trainer: dict[str, Any] = {}
    for path in chain:
        manifest = verify(path)
        incremental = manifest["kind"] == "incremental"
        found = _load_factors(path, derived, set(mine_by_name) - set(derived))
        stored = {tm["name"] for tm in manifest["tables"]}
        absent = sorted(set(mine_by_name) - set(derived) - stored)
        if absent and not incremental:  # it would keep its random initial rows
            raise CheckpointError(f"{path}: table {absent[0]} of the model is not in it")
        for tm in manifest["tables"]:
            spec = specs.get(tm["name"])
            if spec is None:
                raise CheckpointError(f"{path}: table {tm['name']} is not in the model")
            if tm["name"] in derived:
                raise CheckpointError(
                    f"{path}: table {tm['name']} is stored as rows, the model compresses it "
                    "(embedding.compression): resume with the compression it was written with"
                )
            if (tm["num_rows"], tm["dim"]) != (spec.num_rows, spec.dim):
                raise CheckpointError(
                    f"{path}: table {tm['name']} is {tm['num_rows']} x {tm['dim']}, the model's is "
                    f"{spec.num_rows} x {spec.dim}"
                )
            mine = mine_by_name.get(tm["name"], [])
            for _p, storage, _first in mine[:1]:
                want = set(storage.optimizer.state_shapes(1))
                # int8 rows' grid (embedding/low_precision.py): restored where a storage
                # keeps one, else ignored - the rows themselves are in the weight file
                if set(tm["state"]) - ROW_GRID_STATE != want:
                    raise CheckpointError(
                        f"{path}: table {tm['name']} has optimizer state {sorted(tm['state'])}, "
                        f"the model's embedding optimizer keeps {sorted(want)}: resume with "
                        "the embedding.optimizer the checkpoint was written with"
                    )
            for sp in _stored_parts(tm):
                _apply_stored_part(path, manifest["precision"], incremental, sp, mine)
        missing = sorted(set(derived) - found)
        if missing and not incremental:
            raise CheckpointError(
                f"{path}: table {missing[0]} is compressed in the model but the checkpoint has "
                "no factors for it: resume with the embedding.compression it was written with"
            )
        dense = load_dense(path)
        _load_dense_weights(path, model, dense)
        step = dense.get("embedding_step", max(dense.get("storage_steps", [0])))
        if type(step) is not int or step < 0:
            raise CheckpointError(f"{path}: dense.pt's embedding step is {step!r}")
        for storage in ebc.storages():
            storage.step.fill_(step)
        if dense_opt is not None:
            try:
                saved_groups = dense["optimizer"]["param_groups"]
                own_groups = dense_opt.state_dict()["param_groups"]
                if [sorted(g) for g in saved_groups] != [sorted(g) for g in own_groups]:
                    raise ValueError("its hyper-parameters are another optimizer's")
                dense_opt.load_state_dict(dense["optimizer"])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"{path}: the dense optimizer state does not fit optimizer "
                    f"{type(dense_opt).__name__} ({e}): resume with the optimizer.name it was "
                    "written with"
                ) from e
        trainer = trainer_state(path, manifest)
    if "torch_rng" in trainer:
        torch.set_rng_state(torch.from_numpy(trainer["torch_rng"]))
    return trainer
