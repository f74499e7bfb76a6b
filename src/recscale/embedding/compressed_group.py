"""Several QR-compressed tables of one dim as one storage: one gather, combine, pool and
update per factor for all of them, where each table alone took a dozen small ops.

The group's virtual rows are its tables' in order (table ``t`` owns ``[row_lo[t],
row_lo[t] + n_t)``, as any group of an :class:`EmbeddingBagCollection`); its factors
are the tables' factors stacked::

    q.weight  [sum_t ceil(n_t / m_t), D']    |-- Q of table 0 --|-- Q of table 1 --| ...
    r.weight  [sum_t m_t, D']                |-- R of table 0 --|-- R of table 1 --| ...

    virtual row v of table t (local i = v - row_lo[t]):
        Q row  q_lo[t] + i // m_t,   R row  r_lo[t] + i % m_t

Each table keeps its own :class:`QRStorage` (``members``), whose factor tensors - rows,
optimizer state, step counts - are views of the group's: checkpoints, initialisation and
``local_parts`` go through the members unchanged (the same files as tables stored one
by one), while training runs on the stack. The results are the per-table path's to the
bit: a row's gradients are summed in the same order, each factor row updated once.

Only tables whose factors are plain fp32 rows with no hot rows are stacked
(:func:`stackable`); others keep a storage each. Measured on the default model, every
table compressed (2 vCPUs, host A): docs/compression.md, "QR tables stack".
"""

from __future__ import annotations

import torch

from recscale.embedding.compressed import DerivedRows, QRStorage, update_rows
from recscale.embedding.storage import DeviceStorage, RowStorage


def stackable(storage: RowStorage) -> bool:
    """Whether a compressed table's storage can join a :class:`QRGroupStorage`."""
    return (
        isinstance(storage, QRStorage)
        and not storage.hot_rows
        and all(type(f) is DeviceStorage for f in storage.factors.values())
    )


class QRGroupStorage(DerivedRows):
    """QR tables ``members`` (same dim, op and factor widths) trained as one storage."""

    def __init__(self, members: list[QRStorage]) -> None:
        super().__init__()
        first = members[0]
        if not all(stackable(m) for m in members):
            raise ValueError("only QR tables of fp32 factors without hot rows stack")
        if any((m.dim, m.op) != (first.dim, first.op) for m in members):
            raise ValueError("stacked QR tables must share dim and op")
        # not submodules: their tensors are views of the group's (``.to()`` and
        # ``state_dict`` of the group see each value once)
        self.members = tuple(members)
        self.num_rows = sum(m.num_rows for m in members)
        self.dim, self.op, self.optimizer = first.dim, first.op, first.optimizer
        dev = first.device
        self.factors = torch.nn.ModuleDict(
            {
                name: DeviceStorage(
                    sum(m.factors[name].num_rows for m in members),
                    f.dim,
                    first.optimizer,
                    dev,
                    f.kernel,
                )
                for name, f in first.factors.items()
            }
        )
        self.register_buffer("step", first.step.clone())
        lo = {"rows": [0], "q": [0], "r": [0]}
        for m in members:
            lo["rows"].append(lo["rows"][-1] + m.num_rows)
            for name in ("q", "r"):
                lo[name].append(lo[name][-1] + m.factors[name].num_rows)
        self._bounds = lo  # each member's first row of the virtual rows and of each factor
        # per member: its first virtual row, its buckets, its first Q and R rows
        self.register_buffer(
            "member_row_lo", torch.tensor(lo["rows"][:-1], device=dev), persistent=False
        )
        self.register_buffer(
            "member_consts",
            torch.tensor(
                [[m.buckets, lo["q"][i], lo["r"][i]] for i, m in enumerate(members)], device=dev
            ),
            persistent=False,
        )
        with torch.no_grad():  # the members' values (initial or restored) into the stack
            for name, f in self.factors.items():
                for i, m in enumerate(members):
                    for key, t in _tensors(m, name):
                        getattr(f, key)[lo[name][i] : lo[name][i + 1]].copy_(t)
        self._rebind()

    def _rebind(self) -> None:
        """Point every member's factor tensors (and step counts) at the group's."""
        for i, m in enumerate(self.members):
            m._buffers["step"] = self.step
            for name, f in self.factors.items():
                a, b = self._bounds[name][i], self._bounds[name][i + 1]
                mine = m.factors[name]
                for key, _ in _tensors(m, name):
                    mine._buffers[key] = getattr(f, key)[a:b]
                mine._buffers["step"] = f.step

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._rebind()  # a move gave the group new tensors: the members follow
        return out

    @property
    def device(self) -> torch.device:
        return self.factors["q"].device

    def stored_bytes(self) -> int:
        return sum(m.stored_bytes() for m in self.members)

    def init_factors(self, seed: int, features: list[int]) -> None:
        """Each member's factors drawn as that table alone draws them (model table
        ``features[i]`` for member i): the values land in the group's stack."""
        for m, f in zip(self.members, features):
            m.init_factors(seed, f)

    def _index(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        t = torch.searchsorted(self.member_row_lo, rows, right=True) - 1
        c = self.member_consts[t]
        local = rows - self.member_row_lo[t]
        q = torch.div(local, c[:, 0], rounding_mode="floor").add_(c[:, 1])
        return {"q": q, "r": torch.remainder(local, c[:, 0]).add_(c[:, 2])}

    def _gather(self, rows: torch.Tensor):
        idx = self._index(rows)
        return idx, {name: self.factors[name].read_rows(i) for name, i in idx.items()}

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.members[0]._combine(self._gather(rows.to(self.device))[1])

    @torch.no_grad()
    def apply_gradients(self, rows, grad):
        """``rows`` unique, ``grad [U, dim]``: each factor's rows stepped once, as each
        member's ``apply_gradients`` would step its own."""
        self.step.add_(1)
        idx, parts = self._gather(rows)
        grads = self.members[0]._combine_backward(parts, grad)
        for name, f in self.factors.items():
            update_rows(f, idx[name], grads[name])


def _tensors(member: QRStorage, name: str):
    """``(buffer name, tensor)`` of a member's factor ``name``: its rows and optimizer state."""
    f = member.factors[name]
    state = [(f"state_{s}", getattr(f, f"state_{s}")) for s in f.state_names]
    return [("weight", f.weight), *state]
