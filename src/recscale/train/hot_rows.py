"""Choosing the rows of compressed tables that stay exact (``embedding.hot_fraction``).

Before the first step, the first ``embedding.hot_sample_rows`` samples of the global
training stream (the very batches step 0, 1, ... will train on: every rank reads the
same ones, so a sharded run picks what a single process picks) are counted per table;
each compressed table keeps its ``hot_count`` most frequent ids exact (ties: the
smaller id). Counting uses the sample's distinct ids only, never an array of a table's
size. A resumed run restores the ids with the factors and does not count again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from recscale.config.schema import Config
from recscale.train.data_source import sample_id_counts


def top_ids(ids: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most frequent ``ids`` (ties: the smaller id first)."""
    order = np.lexsort((ids, -counts))
    return ids[order[:k]]


def assign_hot_rows(model: torch.nn.Module, cfg: Config, echo: Callable[[str], None]) -> None:
    """Give every compressed table of this process with hot rows its hot ids."""
    e = cfg.embedding
    if not e.hot_fraction:
        return
    targets = {
        p.feature: storage
        for p, storage, _ in model.embeddings.local_parts()
        if getattr(storage, "hot_rows", 0)
    }
    if not targets:
        return
    counts = sample_id_counts(cfg, e.hot_sample_rows, sorted(targets))
    covered = []
    for f, storage in targets.items():
        ids, n = counts[f]
        hot = top_ids(ids, n, storage.hot_rows)
        storage.set_hot_ids(torch.from_numpy(hot))
        covered.append(n[np.isin(ids, hot)].sum() / max(n.sum(), 1))
    k = sum(s.hot_rows for s in targets.values())
    echo(
        f"recscale: hot rows: {k:,} kept exact in {len(targets)} compressed tables "
        f"({100 * e.hot_fraction:g}% of each), "
        f"{100 * float(np.mean(covered)):.0f}% of the sampled lookups on average"
    )
