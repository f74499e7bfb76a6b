"""DLRM (Naumov et al., 2019)::

dense [B, F_dense] -> bottom MLP -> x [B, D] --+
                                                +-> interaction -> top MLP -> logit [B]
jagged ids -> EmbeddingBagCollection -> [B, F*D]+
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from torch import nn

from recscale.config.schema import EmbeddingConfig, ModelConfig
from recscale.data.batch import Batch
from recscale.embedding.cached_storage import CachedStorage
from recscale.embedding.optimizers import build_sparse_optimizer
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec
from recscale.modules.interaction import CatInteraction, DotInteraction
from recscale.modules.mlp import MLP


def ssd_storage_factory(cfg: EmbeddingConfig, tables: list[TableSpec], kernel: str):
    """Storages on the ssd tier: one file per dim group under ``cfg.ssd_dir`` (a temp
    dir when empty), each with its share of ``cfg.cache_bytes`` (default 10% of the
    rows + optimizer state)."""
    root = Path(cfg.ssd_dir) if cfg.ssd_dir else Path(tempfile.mkdtemp(prefix="recscale-ssd-"))
    probe = build_sparse_optimizer(cfg)

    def row_bytes(d: int) -> int:
        return 4 * (d + sum(max(1, math.prod(s)) for s in probe.state_shapes(d).values()))

    total = sum(t.num_rows * row_bytes(t.dim) for t in tables)
    budget = cfg.cache_bytes or total // 10

    def make(num_rows: int, dim: int, optimizer) -> CachedStorage:
        share = budget * num_rows * row_bytes(dim) / max(total, 1)
        rows = max(1, int(share // row_bytes(dim)))
        return CachedStorage(num_rows, dim, optimizer, root / f"tables_dim{dim}.f32", rows,
                             policy=cfg.cache_policy, kernel=kernel)  # fmt: skip

    return make


class DLRM(nn.Module):
    def __init__(
        self,
        model_cfg: ModelConfig,
        embedding_cfg: EmbeddingConfig,
        device: torch.device | None = None,
        seed: int = 0,
        materialize_embeddings: bool = True,
    ) -> None:
        """``materialize_embeddings=False`` leaves the tables on the meta device (no
        memory): for ``recscale.distributed.shard``, which builds each rank's shards."""
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_dense = model_cfg.num_dense_features
        dims = model_cfg.dims()
        tables = [
            TableSpec(f"C{i + 1}", n, d)
            for i, (n, d) in enumerate(zip(model_cfg.table_sizes, dims))
        ]
        self.embeddings = EmbeddingBagCollection(
            tables,
            model_cfg.pooling,
            lambda: build_sparse_optimizer(embedding_cfg),
            validate_ids=embedding_cfg.validate_ids,
            device=device if materialize_embeddings else torch.device("meta"),
            seed=seed,
            kernel=model_cfg.kernels,
            make_storage=(
                ssd_storage_factory(embedding_cfg, tables, model_cfg.kernels)
                if embedding_cfg.placement == "ssd" and materialize_embeddings
                else None
            ),
        )
        self.bottom = (
            MLP(
                self.num_dense,
                model_cfg.bottom_mlp,
                final_activation=True,
                device=device,
                generator=gen,
            )
            if self.num_dense > 0
            else None
        )
        dense_dim = self.bottom.out_dim if self.bottom is not None else 0
        if model_cfg.interaction == "dot":
            self.interaction: nn.Module = DotInteraction(
                len(tables),
                dims[0],
                self.bottom is not None,
                model_cfg.interaction_self,
                kernel=model_cfg.kernels,
            )
        else:
            self.interaction = CatInteraction(self.embeddings.output_dim, dense_dim)
        self.top = MLP(
            self.interaction.out_dim,
            model_cfg.top_mlp,
            final_activation=False,
            device=device,
            generator=gen,
        )

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters a standard torch optimizer trains (everything but the embeddings)."""
        return [p for n, p in self.named_parameters() if not n.startswith("embeddings.")]

    def forward(self, batch: Batch) -> torch.Tensor:
        """Click logits ``[B]``."""
        b = batch.batch_size
        pooled = self.embeddings(batch.values, batch.offsets, b, batch.weights)
        x = self.bottom(batch.dense) if self.bottom is not None else None
        return self.top(self.interaction(x, pooled)).squeeze(1)


def build_model(
    model_cfg: ModelConfig,
    embedding_cfg: EmbeddingConfig,
    device: torch.device | None = None,
    seed: int = 0,
    materialize_embeddings: bool = True,
) -> DLRM:
    return DLRM(model_cfg, embedding_cfg, device, seed, materialize_embeddings)
