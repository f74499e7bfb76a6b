"""The bf16 copies of fp32 master weights that the bf16 node's GEMMs read, kept from the
optimizer's step to the next forward.

Contract: :func:`bf16_copy` returns ``w.to(torch.bfloat16)`` - the kept copy where one
was stored for ``w`` as it is now, else a fresh cast - and marks ``w`` as read in bf16.
An optimizer that updates ``w`` may then write the copy in its own pass and
:func:`keep` it (``train/dense_sgd.py``). "As it is now": the copy is stored with ``w``'s
version counter and storage address; any in-place change through torch (another
optimizer's step, ``load_state_dict``, a user's ``copy_``) bumps the counter and the
next forward casts afresh. Writes that bypass the counter (a native kernel, ``w.data``)
must bump it (``torch.autograd.graph.increment_version``) before :func:`keep`.

Why: the forward's cast is a pass over the weights and a framework op for each, every
step, right after the optimizer's own pass over them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class _Kept:
    ref: weakref.ref  # the weight (ids are reused once it is gone)
    version: int = -1
    address: int = 0
    copy: torch.Tensor | None = None


# id(weight) -> entry; tensors compare elementwise, so they are not dict keys themselves
_kept: dict[int, _Kept] = {}


def _entry(w: torch.Tensor) -> _Kept | None:
    e = _kept.get(id(w))
    return e if e is not None and e.ref() is w else None


def bf16_copy(w: torch.Tensor) -> torch.Tensor:
    """``w`` in bf16: the kept copy if it is ``w``'s current one, else ``w.to(bf16)``."""
    e = _entry(w)
    if e is None:
        key = id(w)
        e = _kept[key] = _Kept(weakref.ref(w, lambda _r: _kept.pop(key, None)))
    elif e.copy is not None and e.version == w._version and e.address == w.data_ptr():
        return e.copy
    e.copy = None
    return w.to(torch.bfloat16)


def wanted(w: torch.Tensor) -> bool:
    """Whether a forward has read ``w`` through :func:`bf16_copy`."""
    return _entry(w) is not None


def keep(w: torch.Tensor, copy: torch.Tensor) -> None:
    """Store ``copy`` (``w`` rounded to bf16, as ``w.to(bf16)`` rounds) for ``w`` as it is
    now. No-op for a weight no forward has read in bf16."""
    e = _entry(w)
    if e is not None:
        e.version, e.address, e.copy = w._version, w.data_ptr(), copy
