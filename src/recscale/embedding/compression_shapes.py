"""What a compressed table is made of, as plain numbers (no torch): which method each
table takes from ``embedding.compression`` and its overrides, and the shapes of its
factor tables. The storages (``compressed.py``) allocate these shapes and the planner
counts their bytes (``sizing.py``), so both read them here.

    qr         q [ceil(n/m), D'], r [m, D']      (D' = D/2 under qr_op="concat")
    mixed_dim  w [n, d_t], proj [d_t, D]         (d_t by the power rule, ``mixed_dims``)
    tt         g1 [n1, d1 R], g2 [n2, R d2 R], g3 [n3, R d3]   (``tt_shape``)
"""

from __future__ import annotations

import math


def tt_shape(num_rows: int, dim: int) -> tuple[list[int], list[int]]:
    """``(n1, n2, n3)`` with ``n1 n2 n3 >= num_rows`` (near-equal), ``(d1, d2, d3)`` with
    ``d1 d2 d3 == dim`` (the most balanced factorization); ValueError if ``dim`` has no
    factorization into three factors > 1 (the TT cores would degenerate)."""
    c = math.ceil(num_rows ** (1 / 3))
    n = [c, c, max(1, math.ceil(num_rows / (c * c)))]
    best = None
    for d1 in range(2, dim + 1):
        for d2 in range(2, dim // d1 + 1):
            if dim % (d1 * d2) == 0 and dim // (d1 * d2) >= 2:
                ds = sorted([d1, d2, dim // (d1 * d2)])
                if best is None or ds[-1] - ds[0] < best[-1] - best[0]:
                    best = ds
    if best is None:
        raise ValueError(f"dim {dim} is not a product of three factors > 1")
    return n, best


def mixed_dims(table_rows: list[int], dim: int, alpha: float) -> list[int]:
    """The power rule: ``d_t = dim * (n_min / n_t) ** alpha``, rounded down to a power of
    two and at least 1 - the smallest table (whose rows are the most popular when ids
    spread over a table's rows) keeps ``dim``, larger tables get fewer dimensions."""
    n_min = min(table_rows)
    out = []
    for n in table_rows:
        d = dim * (n_min / n) ** alpha
        out.append(dim if d >= dim else max(1, 2 ** int(math.floor(math.log2(max(d, 1.0))))))
    return out


# factors used whole in every lookup (not gathered by row): kept fp32 at any row_precision
WHOLE_FACTORS = frozenset({"proj"})


def factor_precision(name: str, row_precision: str) -> str:
    """How factor (or ``"hot"`` rows) ``name`` is stored at ``embedding.row_precision``:
    the storage and the planner's byte count both ask here."""
    return "fp32" if name in WHOLE_FACTORS else row_precision


def factor_shapes(
    method: str,
    num_rows: int,
    dim: int,
    qr_buckets: int = 1,
    qr_op: str = "mult",
    tt_rank: int = 1,
    small_dim: int = 1,
) -> dict[str, tuple[int, int]]:
    """Factor name -> (rows, width) of a compressed table: what the storages allocate
    and what the planner counts."""
    if method == "qr":
        m, width = min(qr_buckets, num_rows), dim // 2 if qr_op == "concat" else dim
        return {"q": (math.ceil(num_rows / m), width), "r": (m, width)}
    if method == "mixed_dim":
        return {"w": (num_rows, small_dim), "proj": (small_dim, dim)}
    if method == "tt":
        (n1, n2, n3), (d1, d2, d3) = tt_shape(num_rows, dim)
        r = tt_rank
        return {"g1": (n1, d1 * r), "g2": (n2, r * d2 * r), "g3": (n3, r * d3)}
    raise ValueError(f"unknown compression {method!r}")


def compressed_rows(method: str, num_rows: int, dim: int, **factor_args) -> int:
    """fp32 values a compressed table stores (its factors, ``factor_args`` as
    :func:`factor_shapes` takes them), without building it."""
    shapes = factor_shapes(method, num_rows, dim, **factor_args)
    return sum(rows * width for rows, width in shapes.values())


def table_compressions(table_sizes: list[int], dims: list[int], cfg) -> list[tuple[str, int]]:
    """Per table ``(method, small_dim)`` from ``embedding.compression`` and its per-table
    overrides (``cfg`` an ``EmbeddingConfig``); ``small_dim`` is mixed_dim's d_t (else 0).
    Tables under ``compress_min_rows`` stay ``"none"`` unless named in an override, and
    so does a table its method would not shrink."""
    names = [f"C{i + 1}" for i in range(len(table_sizes))]
    methods = dict(str(x).split("=", 1) for x in cfg.table_compression)
    # the global method skips tables under compress_min_rows; a named override does not
    chosen = [
        methods.get(n, cfg.compression if rows >= cfg.compress_min_rows else "none")
        for n, rows in zip(names, table_sizes)
    ]
    md = [i for i, m in enumerate(chosen) if m == "mixed_dim"]
    small = (
        dict(zip(md, mixed_dims([table_sizes[i] for i in md], max(dims), cfg.md_alpha)))
        if md
        else {}
    )
    args = dict(qr_buckets=cfg.qr_buckets, qr_op=cfg.qr_op, tt_rank=cfg.tt_rank)
    out = []
    for i, (n, d, m) in enumerate(zip(table_sizes, dims, chosen)):
        sd = min(small.get(i, 0), d)
        if m != "none" and compressed_rows(m, n, d, **args, small_dim=sd) >= n * d:
            m, sd = "none", 0
        if m == "mixed_dim" and sd >= d:
            m, sd = "none", 0
        out.append((m, sd if m == "mixed_dim" else 0))
    return out


def hot_id_bytes(num_rows: int, hot_rows: int) -> int:
    """Bytes of a hot row's id: int32 where the table's ids and the free slots' fit."""
    return 4 if num_rows + hot_rows < 2**31 else 8


def hot_count(num_rows: int, fraction: float) -> int:
    """Rows of a compressed table kept exact at ``embedding.hot_fraction``."""
    return min(num_rows, math.ceil(fraction * num_rows)) if fraction > 0 else 0
