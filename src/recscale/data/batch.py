"""The jagged batch: the one input format of every layer above ``data/``.

Layout for B samples, F sparse features (feature-major, like TorchRec's KJT)::

    dense    [B, F_dense] float32
    values   [N] int64          ids of feature 0 for samples 0..B-1, then feature 1, ...
    offsets  [F*B + 1] int64    ids of sample b of feature f are
                                values[offsets[f*B + b] : offsets[f*B + b + 1]]
    weights  [N] float32 | None optional per-id weights (weighted pooling)
    labels   [B] float32        0/1 click labels

A bag may be empty (``offsets[i] == offsets[i+1]``); ``offsets[0] == 0`` and
``offsets[-1] == N``. Ids are local to their feature's table (0 .. rows-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    dense: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    @property
    def num_sparse_features(self) -> int:
        return (self.offsets.shape[0] - 1) // max(self.batch_size, 1)

    def lengths(self) -> torch.Tensor:
        """Ids per (feature, sample) bag, ``[F*B]``."""
        return self.offsets[1:] - self.offsets[:-1]

    def feature_values(self, f: int) -> torch.Tensor:
        b = self.batch_size
        return self.values[self.offsets[f * b] : self.offsets[(f + 1) * b]]

    def slice(self, lo: int, hi: int) -> Batch:
        """Samples ``[lo, hi)`` as a batch of the same layout (rank ``r`` of ``W`` trains on
        ``slice(r * B // W, (r + 1) * B // W)`` of the global batch). Each feature's ids of
        those samples are one run of ``values``, so the cost is the slice's, not the
        batch's: an eval set cut into small batches took time quadratic in its size."""
        b, f = self.batch_size, self.num_sparse_features
        starts = self.offsets[: f * b].view(f, b)[:, lo:hi]
        new_len = (self.offsets[1:].view(f, b)[:, lo:hi] - starts).reshape(-1)
        offsets = torch.zeros(new_len.shape[0] + 1, dtype=torch.int64, device=new_len.device)
        torch.cumsum(new_len, 0, out=offsets[1:])
        # each feature's run: [offsets[i*B + lo], offsets[i*B + hi]) (one read-back)
        first = torch.arange(f, device=self.offsets.device) * b
        spans = self.offsets[torch.stack([first + lo, first + hi])].t().tolist() if hi > lo else []

        def cut(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[s:e] for s, e in spans]) if spans else t[:0]

        return Batch(
            dense=self.dense[lo:hi],
            values=cut(self.values),
            offsets=offsets,
            labels=self.labels[lo:hi],
            weights=None if self.weights is None else cut(self.weights),
        )

    @staticmethod
    def cat(parts: list[Batch]) -> Batch:
        """The samples of ``parts``, in order, as one batch of the same layout (each
        feature's ids stay together: feature-major)."""
        f = parts[0].num_sparse_features
        lengths = torch.cat([p.lengths().view(f, p.batch_size) for p in parts], 1).reshape(-1)
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])

        def by_feature(of: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(
                [
                    t[p.offsets[i * p.batch_size] : p.offsets[(i + 1) * p.batch_size]]
                    for i in range(f)
                    for p, t in zip(parts, of)
                ]
            )

        weighted = all(p.weights is not None for p in parts)
        return Batch(
            dense=torch.cat([p.dense for p in parts]),
            values=by_feature([p.values for p in parts]),
            offsets=offsets,
            labels=torch.cat([p.labels for p in parts]),
            weights=by_feature([p.weights for p in parts]) if weighted else None,
        )

    def pad(self, batch_size: int) -> Batch:
        """Append samples with empty bags, zero dense features and label 0 up to
        ``batch_size`` (ranks must run equal batches; padded predictions are dropped)."""
        b, f, extra = self.batch_size, self.num_sparse_features, batch_size - self.batch_size
        if extra <= 0:
            return self
        lengths = self.lengths().view(f, b)
        new_len = torch.cat([lengths, lengths.new_zeros(f, extra)], 1).reshape(-1)
        offsets = torch.zeros(new_len.shape[0] + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(new_len, 0, out=offsets[1:])
        return Batch(
            dense=torch.cat([self.dense, self.dense.new_zeros(extra, self.dense.shape[1])]),
            values=self.values,
            offsets=offsets,
            labels=torch.cat([self.labels, self.labels.new_zeros(extra)]),
            weights=self.weights,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(
            dense=move(self.dense),
            values=move(self.values),
            offsets=move(self.offsets),
            labels=move(self.labels),
            weights=move(self.weights),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.dense, self.values, self.offsets, self.labels, self.weights)
            if t is not None
        ]

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory (asynchronous copies to a GPU)."""

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return Batch(
            dense=pin(self.dense),
            values=pin(self.values),
            offsets=pin(self.offsets),
            labels=pin(self.labels),
            weights=pin(self.weights),
        )

    def check(self, num_dense: int, num_sparse: int) -> None:
        """Validate shapes and offsets; raises ValueError describing the first problem."""
        b = self.batch_size
        if self.dense.shape != (b, num_dense):
            raise ValueError(
                f"dense has shape {tuple(self.dense.shape)}, expected ({b}, {num_dense})"
            )
        if self.offsets.shape != (num_sparse * b + 1,):
            raise ValueError(
                f"offsets has shape {tuple(self.offsets.shape)}, expected ({num_sparse * b + 1},) "
                f"for {num_sparse} features x {b} samples"
            )
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.values.shape[0]:
            raise ValueError("offsets must start at 0 and end at len(values)")
        if bool((self.lengths() < 0).any()):
            raise ValueError("offsets must be non-decreasing")
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError("weights must have one entry per id")

    @staticmethod
    def from_lists(
        dense: list[list[float]],
        sparse: list[list[list[int]]],
        labels: list[float],
        weights: list[list[list[float]]] | None = None,
    ) -> Batch:
        """Build from nested lists: ``sparse[f][b]`` is the id list of sample b, feature f.

        Convenient for tests and small examples; not a fast path.
        """
        values: list[int] = []
        w: list[float] = []
        offsets = [0]
        for f, per_sample in enumerate(sparse):
            for b, ids in enumerate(per_sample):
                values.extend(ids)
                if weights is not None:
                    w.extend(weights[f][b])
                offsets.append(len(values))
        return Batch(
            dense=torch.tensor(dense, dtype=torch.float32).reshape(len(labels), -1),
            values=torch.tensor(values, dtype=torch.int64),
            offsets=torch.tensor(offsets, dtype=torch.int64),
            labels=torch.tensor(labels, dtype=torch.float32),
            weights=None if weights is None else torch.tensor(w, dtype=torch.float32),
        )
