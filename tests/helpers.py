"""Shared helpers for tests: random jagged batches and per-table references."""

from __future__ import annotations

import torch

from recscale.data.batch import Batch


def random_jagged(
    table_sizes: list[int],
    batch_size: int,
    max_len: int = 4,
    weighted: bool = False,
    seed: int = 0,
    hot_ids: bool = True,
) -> Batch:
    """A batch with bag lengths in [0, max_len] (empty bags included) and, with
    ``hot_ids``, ids drawn from a few values so rows repeat within and across bags."""
    g = torch.Generator().manual_seed(seed)
    num_f = len(table_sizes)
    lengths = torch.randint(0, max_len + 1, (num_f, batch_size), generator=g)
    values = []
    for f, n in enumerate(table_sizes):
        count = int(lengths[f].sum())
        hi = min(n, 3) if hot_ids else n
        values.append(torch.randint(0, hi, (count,), generator=g))
    offsets = torch.zeros(num_f * batch_size + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    vals = torch.cat(values)
    return Batch(
        dense=torch.randn(batch_size, 13, generator=g),
        values=vals,
        offsets=offsets,
        labels=torch.randint(0, 2, (batch_size,), generator=g).float(),
        weights=torch.rand(vals.shape[0], generator=g) if weighted else None,
    )


def per_feature_inputs(
    batch: Batch, f: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, offsets incl. last, weights) of feature f alone, for nn.EmbeddingBag."""
    b = batch.batch_size
    start, end = int(batch.offsets[f * b]), int(batch.offsets[(f + 1) * b])
    offs = batch.offsets[f * b : (f + 1) * b + 1] - start
    w = None if batch.weights is None else batch.weights[start:end]
    return batch.values[start:end], offs, w


def make_dataset(root, lines: int, seed: int, hash_size: int):
    """A small preprocessed dataset (split 'train' only) from synthetic Criteo lines."""
    from recscale.data.criteo_tsv_writer import synthetic_lines
    from recscale.data.preprocess import PreprocessOptions, preprocess

    src = root / "in.tsv"
    src.write_text("\n".join(synthetic_lines(lines, seed=seed)) + "\n")
    opts = PreprocessOptions(inputs=[src], out=root / "ds", hash_sizes=[hash_size], split="none")
    preprocess(opts, echo=lambda s: None)
    return root / "ds"
