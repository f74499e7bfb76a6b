"""A table's initial rows, drawable piece by piece: any row block or column block of a
table gets exactly the values the whole table would, without drawing the rest.

Rows are drawn in chunks of ``INIT_CHUNK_ROWS``, chunk ``c`` of table ``feature`` from
its own generator seeded by ``chunk_seed(seed, feature, c)``::

    table [num_rows, dim]  = chunk 0 | chunk 1 | ... (U(-sqrt(1/n), sqrt(1/n)), row-major)
    a shard [row_lo:row_hi, col_lo:col_hi] = the same values, cut from its chunks
"""

from __future__ import annotations

import math

import torch

from recscale.torch_threads import on_torch_threads

INIT_CHUNK_ROWS = 1 << 16
INIT_THREADS = "recscale-init"  # the threads' names


def chunk_seed(seed: int, feature: int, chunk: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + feature * 0xBF58476D1CE4E5B9 + chunk) % (1 << 63)


@torch.no_grad()
def init_table_rows(
    out: torch.Tensor,
    seed: int,
    feature: int,
    num_rows: int,
    dim: int,
    row_lo: int,
    row_hi: int,
    col_lo: int,
    col_hi: int,
) -> None:
    """Fill ``out [row_hi - row_lo, col_hi - col_lo]`` with rows ``[row_lo, row_hi)`` and
    columns ``[col_lo, col_hi)`` of table ``feature``'s initial weights.

    Reference DLRM: U(-sqrt(1/n), sqrt(1/n)) for a table of n rows. Every chunk of
    ``INIT_CHUNK_ROWS`` rows has its own generator seeded by (seed, feature, chunk), so
    any shard (a row block, a column block) is initialised to exactly the values the
    whole table would hold, without drawing the rest; and temporaries stay bounded.

    The chunks are drawn on torch's threads at once (each its own generator: the values
    do not depend on the order), and a chunk ``out`` holds whole - every column, fp32 on
    the CPU - is drawn in place: a contiguous block draws the same sequence as a fresh
    tensor of its shape. Config B's 13 GB of tables took 22 s to draw (one thread, then
    a copy that first touched every page)."""
    bound = math.sqrt(1.0 / num_rows)
    first, last = row_lo // INIT_CHUNK_ROWS, (row_hi - 1) // INIT_CHUNK_ROWS
    in_place = (
        (col_lo, col_hi) == (0, dim)
        and out.device.type == "cpu"
        and out.dtype == torch.float32
        and out.is_contiguous()
    )

    def draw(c: int) -> None:
        lo, hi = c * INIT_CHUNK_ROWS, min(num_rows, (c + 1) * INIT_CHUNK_ROWS)
        gen = torch.Generator().manual_seed(chunk_seed(seed, feature, c))
        a, b = max(lo, row_lo), min(hi, row_hi)
        if in_place and (a, b) == (lo, hi):
            out[a - row_lo : b - row_lo].uniform_(-bound, bound, generator=gen)
            return
        chunk = torch.empty(hi - lo, dim).uniform_(-bound, bound, generator=gen)
        out[a - row_lo : b - row_lo].copy_(chunk[a - lo : b - lo, col_lo:col_hi])

    on_torch_threads(draw, range(first, last + 1) if row_hi > row_lo else range(0), INIT_THREADS)
