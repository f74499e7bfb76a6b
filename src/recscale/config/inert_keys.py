"""Keys that act only under another key's setting: set away from their default without
it, they would change nothing, without a word (``--embedding.beta1=0.8`` under row-wise
Adagrad, ``--model.dcn_rank=256`` under the dot interaction). Such a value is refused,
naming the key and the setting it needs. Values at their defaults pass: a TOML file
that spells every key out (``configs/default.toml``) stays valid under any choice. A
run's own config.toml read back (eval, resume) is not held to rules added after it was
written: there only the keys the command gives are checked, and the file's values of
keys that never acted are set back to their defaults (``drop_inert_values``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from recscale.config.compression_rules import table_methods
from recscale.config.errors import ConfigError, value_text


def _methods(cfg: Any) -> set[str]:
    """The compression methods some table of the config is given."""
    return set(table_methods(cfg).values())


# The keys of the ssd and host tiers (their file, cache and I/O) act on tables placed
# there: by embedding.placement, or by a plan file's placements.
_TIERED = "embedding.placement=ssd, host or auto (or a distributed.plan file)"


def _tiered(cfg: Any) -> bool:
    return cfg.embedding.placement != "device" or bool(cfg.distributed.plan)


# (key, does it act under cfg, the setting it needs - as the message says it)
RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("embedding.beta1", lambda c: c.embedding.optimizer == "adam", "embedding.optimizer=adam"),
    ("embedding.beta2", lambda c: c.embedding.optimizer == "adam", "embedding.optimizer=adam"),
    (
        "embedding.initial_accumulator",
        lambda c: c.embedding.optimizer == "rowwise_adagrad",
        "embedding.optimizer=rowwise_adagrad",
    ),
    ("model.interaction_self", lambda c: c.model.interaction == "dot", "model.interaction=dot"),
    ("model.dcn_layers", lambda c: c.model.interaction == "dcnv2", "model.interaction=dcnv2"),
    ("model.dcn_rank", lambda c: c.model.interaction == "dcnv2", "model.interaction=dcnv2"),
    ("embedding.qr_buckets", lambda c: "qr" in _methods(c), "a table compressed by qr"),
    ("embedding.qr_op", lambda c: "qr" in _methods(c), "a table compressed by qr"),
    ("embedding.md_alpha", lambda c: "mixed_dim" in _methods(c), "a table compressed by mixed_dim"),
    ("embedding.tt_rank", lambda c: "tt" in _methods(c), "a table compressed by tt"),
    (
        "embedding.hot_sample_rows",
        lambda c: c.embedding.hot_fraction > 0,
        "embedding.hot_fraction > 0",
    ),
    *(
        (f"embedding.{name}", _tiered, _TIERED)
        for name in (
            "ssd_dir",
            "cache_bytes",
            "cache_policy",
            "io_depth",
            "ssd_access",
            "cache_prefetch",
            "io_stall_seconds",
            "row_order",
            "order_sample_rows",
            "warm_start",
            "warm_pin_share",
        )
    ),
    ("optimizer.decay", lambda c: c.optimizer.decay_steps > 0, "optimizer.decay_steps > 0"),
    ("optimizer.decay_to", lambda c: c.optimizer.decay_steps > 0, "optimizer.decay_steps > 0"),
)


def _inert(cfg: Any) -> list[tuple[str, Any, Any, str]]:
    """``(key, value, default, the setting it needs)`` of each key of ``RULES`` set away
    from its default where the setting it acts under is not made."""
    found = []
    for key, acts, needs in RULES:
        section_name, name = key.split(".")
        section = getattr(cfg, section_name)
        value, default = getattr(section, name), getattr(type(section)(), name)
        if value != default and not acts(cfg):
            found.append((key, value, default, needs))
    return found


def refuse_inert_keys(cfg: Any, only: Iterable[str] | None = None) -> None:
    """Raise ConfigError for the first inert key (``cfg``: a ``schema.Config``);
    ``only``: of these keys alone (a saved run's config.toml, read back: the keys the
    command gives)."""
    checked = None if only is None else set(only)
    for key, value, _, needs in _inert(cfg):
        if checked is None or key in checked:
            raise ConfigError(
                key, f"{value_text(value)} acts only with {needs}, which this config does not set"
            )


def drop_inert_values(cfg: Any) -> list[str]:
    """Set every inert key back to its default (it changed nothing where it was);
    returns the keys so reset."""
    found = _inert(cfg)
    for key, _, default, _ in found:
        section_name, name = key.split(".")
        setattr(getattr(cfg, section_name), name, default)
    return [key for key, *_ in found]
