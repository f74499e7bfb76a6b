"""Independent pieces of host work on as many Python threads as torch has threads
(:func:`on_torch_threads`), and torch's intra-op thread count set for a block
(:func:`torch_threads_set`).

For loops whose body lets go of the GIL (numpy's loops, torch ops): a table's initial
rows drawn a chunk at a time, the synthetic source's id effects hashed a piece at a
time. Each piece writes its own rows, so no piece waits on another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


def on_torch_threads(
    work: Callable[[T], None], pieces: Sequence[T], name: str, at_once: bool = True
) -> None:
    """``work(p)`` for every piece, on ``torch.get_num_threads()`` threads named
    ``name`` (one thread, this one, when not ``at_once``); a piece's error is raised
    here."""
    workers = min(torch.get_num_threads(), len(pieces)) if at_once else 1
    if workers <= 1:
        for p in pieces:
            work(p)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        list(pool.map(work, pieces))  # re-raises a piece's error


@contextmanager
def torch_threads_set(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the count before it after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
