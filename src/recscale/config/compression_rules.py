"""Rules across sections for compressed tables (``embedding.compression``,
``table_compression``): each table's method fits its dim, and a compressed table is
placed whole. Kept apart from ``schema.py``, whose classes each hold one component's keys."""

from __future__ import annotations

from typing import Any

from recscale.config.errors import ConfigError


def table_methods(cfg: Any) -> dict[str, str]:
    """Each table's compression method (``table_compression``'s ``NAME=METHOD``, else
    ``compression``), by table name; the overrides' names as given (checked below)."""
    e, names = cfg.embedding, [f"C{i + 1}" for i in range(len(cfg.model.table_sizes))]
    named = dict(str(x).split("=", 1) for x in e.table_compression)
    return {n: named.get(n, e.compression) for n in names} | {
        n: m for n, m in named.items() if n not in names
    }


def check_compression(cfg: Any) -> None:
    """Each table's compression of ``cfg`` (a ``schema.Config``) fits its dim, its tier
    and the sharding; raises ConfigError naming the key."""
    e, names = cfg.embedding, [f"C{i + 1}" for i in range(len(cfg.model.table_sizes))]
    methods = table_methods(cfg)
    unknown = sorted(set(methods) - set(names))
    if unknown:
        raise ConfigError("embedding.table_compression", f"no table named {unknown[0]}")
    used = set(methods.values()) - {"none"}
    if not used:
        if e.hot_fraction:
            raise ConfigError(
                "embedding.hot_fraction",
                "keeps rows of compressed tables exact; no table is "
                "compressed (set embedding.compression)",
            )
        return
    if cfg.distributed.sharding not in ("auto", "table_wise"):
        raise ConfigError(
            "embedding.compression",
            f"a compressed table is placed whole; distributed.sharding="
            f"{cfg.distributed.sharding} would split it (use auto or table_wise)",
        )
    for n, d in zip(names, cfg.model.dims()):
        m = methods[n]
        if m == "qr" and e.qr_op == "concat" and d % 2:
            raise ConfigError("embedding.qr_op", f"concat halves the dim; {n} has odd dim {d}")
        if m == "tt" and not any(
            d % (a * b) == 0 and d // (a * b) >= 2
            for a in range(2, d + 1)
            for b in range(2, d // a + 1)
        ):
            raise ConfigError(
                "embedding.compression",
                f"tt factors the dim into three; {n}'s dim {d} has no such factors",
            )
