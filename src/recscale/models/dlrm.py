"""DLRM (Naumov et al., 2019)::

dense [B, F_dense] -> bottom MLP -> x [B, D] --+
                                                +-> interaction -> top MLP -> logit [B]
jagged ids -> EmbeddingBagCollection -> [B, F*D]+
"""

from __future__ import annotations

import torch
from torch import nn

from recscale.config.schema import EmbeddingConfig, ModelConfig
from recscale.data.batch import Batch
from recscale.embedding.compression_shapes import table_compressions
from recscale.embedding.optimizers import build_sparse_optimizer
from recscale.embedding.placement import device_storage_factory
from recscale.modules.dcn import DCNv2Interaction
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec
from recscale.modules.interaction import CatInteraction, DotInteraction
from recscale.modules.mlp import MLP


def table_specs(model_cfg: ModelConfig, embedding_cfg: EmbeddingConfig) -> list[TableSpec]:
    """Per-table specs: name, rows, dim and compression. Every table is a device table
    here; the plan decides tiers (``shard`` builds host/ssd storages from it)."""
    dims = model_cfg.dims()
    comp = table_compressions(model_cfg.table_sizes, dims, embedding_cfg)
    return [
        TableSpec(f"C{i + 1}", n, d, "device", 0, m, sd)
        for i, (n, d, (m, sd)) in enumerate(zip(model_cfg.table_sizes, dims, comp))
    ]


class DLRM(nn.Module):
    def __init__(
        self,
        model_cfg: ModelConfig,
        embedding_cfg: EmbeddingConfig,
        device: torch.device | None = None,
        seed: int = 0,
        materialize_embeddings: bool = True,
        init_rows: bool = True,
    ) -> None:
        """``materialize_embeddings=False`` leaves the tables on the meta device (no
        memory): for ``recscale.distributed.shard``, which builds each rank's shards and
        their tiers from the plan (``train.parallel.build``). ``init_rows=False``: a
        checkpoint is restored into the model next; its rows are not drawn."""
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_dense = model_cfg.num_dense_features
        dims = model_cfg.dims()
        tables = table_specs(model_cfg, embedding_cfg)
        self.embeddings = EmbeddingBagCollection(
            tables,
            model_cfg.pooling,
            lambda: build_sparse_optimizer(embedding_cfg),
            validate_ids=embedding_cfg.validate_ids,
            device=device if materialize_embeddings else torch.device("meta"),
            seed=seed,
            kernel=model_cfg.kernels,
            make_storage=(
                device_storage_factory(embedding_cfg, device, model_cfg.kernels)
                if materialize_embeddings
                else None
            ),
            init_rows=init_rows,
        )
        self.bottom = (
            MLP(
                self.num_dense,
                model_cfg.bottom_mlp,
                final_activation=True,
                device=device,
                generator=gen,
                fused=model_cfg.kernels != "torch",
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
        elif model_cfg.interaction == "dcnv2":
            self.interaction = DCNv2Interaction(
                self.embeddings.output_dim,
                dense_dim,
                model_cfg.dcn_layers,
                model_cfg.dcn_rank,
                device=device,
                generator=gen,
                fused=model_cfg.kernels != "torch",
            )
        else:
            self.interaction = CatInteraction(self.embeddings.output_dim, dense_dim)
        self.top = MLP(
            self.interaction.out_dim,
            model_cfg.top_mlp,
            final_activation=False,
            device=device,
            generator=gen,
            fused=model_cfg.kernels != "torch",
        )

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters a standard torch optimizer trains (everything but the embeddings)."""
        return [p for n, p in self.named_parameters() if not n.startswith("embeddings.")]

    def embed(self, batch: Batch) -> torch.Tensor:
        """The pooled embeddings in the layout the interaction takes: ``[B, F, D]`` for
        the dot interaction (no copy, see ``pooled_by_feature``; bf16 where it takes
        them so), else ``[B, sum D_f]``."""
        args = (batch.values, batch.offsets, batch.batch_size, batch.weights)
        if isinstance(self.interaction, DotInteraction):
            # bf16 sums where the interaction reads them so (CPU, bf16 autocast)
            bf16 = self.interaction.takes_bf16_pooled(batch.values.device)
            return self.embeddings.pooled_by_feature(*args, bf16=bf16)
        return self.embeddings(*args)

    def forward(self, batch: Batch, mark=None, check_finite: bool = False) -> torch.Tensor:
        """Click logits ``[B]``. ``mark`` (a benchmark's clock) is called after each stage:
        the embedding lookup, the bottom MLP, the interaction (the top MLP ends it).

        ``check_finite``: NaN or inf in the interaction's output (a NaN embedding row, an
        overflow) makes the logits NaN. Without it a fused ReLU (oneDNN's post-op maps NaN
        to 0) can hide them from the loss. The test is the sum's finiteness (a NaN or inf
        anywhere makes it so; 0.05 ms for [2048, 512] where ``isfinite().all()`` takes
        1.2), so training checks every step."""
        pooled = self.embed(batch)
        if mark is not None:
            mark()
        x = self.bottom(batch.dense) if self.bottom is not None else None
        if mark is not None:
            mark()
        z = self.interaction(x, pooled)
        if mark is not None:
            mark()
        logits = self.top(z).squeeze(1)
        if check_finite and not bool(z.sum(dtype=torch.float32).isfinite()):
            logits = logits + float("nan")
        return logits


def build_model(
    model_cfg: ModelConfig,
    embedding_cfg: EmbeddingConfig,
    device: torch.device | None = None,
    seed: int = 0,
    materialize_embeddings: bool = True,
    init_rows: bool = True,
) -> DLRM:
    model = DLRM(model_cfg, embedding_cfg, device, seed, materialize_embeddings, init_rows)
    if device is not None and materialize_embeddings:
        model.to(device)  # the index buffers of the interaction too
    return model
