"""Every rank runs the same config: checked once, before anything is built.

torchrun starts each rank with its own command line, and each node reads its own copy
of the config file and the dataset's metadata. Ranks that disagree build different
models and issue different collectives: measured with two gloo ranks, a different
``model.embedding_dim`` or ``embedding.optimizer`` on one rank trained to the end
without a word, a different ``train.batch_size`` aborted in gloo, a different
``train.steps`` hung until ``distributed.timeout_s``. So each rank settles its config
(dataset shapes, steps from epochs), the ranks exchange the result (one all-gather of
a few kB) and either all go on or all stop with the same line, naming the rank and
the key::

    rank r settles  ->  ("ok", {"model.embedding_dim": 16, ...})  or  ("error", ...)
    all_gather      ->  every rank holds every rank's answer
    any failure     ->  every rank raises it (the failing rank its own exception, the
                        others its ConfigError, or RankFailed with its line)
    a key that differs from rank 0's (outside RANK_LOCAL_KEYS)  ->  ConfigError(key)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.distributed import DistContext

# Keys a rank may set for itself: where its files are, its threads, its reads' depth
# and cache, how it waits and shows progress. None of them changes what a step
# computes or which collectives it issues (the calibration is rank 0's, broadcast).
RANK_LOCAL_KEYS = frozenset(
    {
        "data.path",  # a node's own copy: its shapes and rows are compared instead
        "data.prefetch_batches",
        "embedding.ssd_dir",
        "embedding.cache_bytes",  # sized from the memory each node has free
        "embedding.io_depth",
        "embedding.ssd_access",
        "embedding.cache_prefetch",
        "train.threads",
        "train.progress",
        "train.host_memory",
        "distributed.calibration",
        "distributed.timeout_s",
    }
)


class RankFailed(RuntimeError):
    """Another rank could not set up its run (its own error is on its own output)."""


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` over every key of ``cfg``."""
    return {
        f"{section.name}.{key}": value
        for section in dataclasses.fields(cfg)
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items()
    }


def settle_on_every_rank(settle: Callable[[], Config], ctx: DistContext) -> Config:
    """``settle()`` on this rank; on several ranks, its outcome checked against every
    other rank's: one rank's failure, or a key whose value differs from rank 0's, is
    raised on every rank (none is left waiting in a collective for the others)."""
    if not ctx.distributed:
        return settle()
    failure: BaseException | None = None
    cfg: Config | None = None
    try:
        cfg = settle()
        got: tuple[str, Any] = (
            "ok",
            {k: v for k, v in flat_config(cfg).items() if k not in RANK_LOCAL_KEYS},
        )
    except ConfigError as e:
        failure, got = e, ("config", (e.key, e.message))
    except Exception as e:  # noqa: BLE001 - any failure here must reach every rank
        failure, got = e, ("error", f"{type(e).__name__}: {e}")
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, got, group=ctx.dense)
    for rank, (kind, value) in enumerate(every):
        if kind == "ok":
            continue
        if failure is not None:  # this rank's own failure, with its traceback
            raise failure
        if kind == "config":
            raise ConfigError(value[0], f"on rank {rank}: {value[1]}")
        raise RankFailed(f"rank {rank} could not set up its run: {value}")
    assert cfg is not None
    _check_same(every)
    return cfg


def _check_same(every: list[tuple[str, dict[str, Any]]]) -> None:
    ref = every[0][1]
    for rank, (_, theirs) in enumerate(every[1:], 1):
        keys = sorted(k for k in ref.keys() | theirs.keys() if ref.get(k) != theirs.get(k))
        if not keys:
            continue
        key = keys[0]
        more = f" (and {', '.join(keys[1:])})" if len(keys) > 1 else ""
        raise ConfigError(
            key,
            f"rank {rank} runs {theirs.get(key)!r} where rank 0 runs {ref.get(key)!r}{more}: "
            "every rank must run the same config and dataset shapes (a node with its own "
            "copy of the config file or the dataset?); only paths, threads, I/O and "
            "progress keys may differ by rank",
        )
