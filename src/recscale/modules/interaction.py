"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Inputs: ``dense_BD`` ``[B, D]`` (or None when there are no dense features) and
``pooled_BX`` ``[B, sum_f D_f]`` from :class:`EmbeddingBagCollection`.
"""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """DLRM's dot interaction: pairwise dot products of the F(+1) vectors.

    ``T = [dense; e_1; ...; e_F]`` is ``[B, K, D]``; ``Z = T T^T`` is ``[B, K, K]``; the
    output is ``[dense, upper_triangle(Z)]`` with the diagonal only if ``self_interaction``.
    """

    def __init__(
        self, num_features: int, dim: int, has_dense: bool, self_interaction: bool = False
    ):
        super().__init__()
        self.num_features, self.dim, self.has_dense = num_features, dim, has_dense
        k = num_features + (1 if has_dense else 0)
        iu = torch.triu_indices(k, k, offset=0 if self_interaction else 1)
        self.register_buffer("flat_index", iu[0] * k + iu[1], persistent=False)
        self.num_pairs = iu.shape[1]
        self.out_dim = self.num_pairs + (dim if has_dense else 0)

    def forward(self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor) -> torch.Tensor:
        b = pooled_BX.shape[0]
        emb_BFD = pooled_BX.view(b, self.num_features, self.dim)
        t_BKD = torch.cat([dense_BD.unsqueeze(1), emb_BFD], dim=1) if self.has_dense else emb_BFD
        z_BKK = torch.bmm(t_BKD, t_BKD.transpose(1, 2))
        pairs_BP = z_BKK.flatten(1).index_select(1, self.flat_index)
        return torch.cat([dense_BD, pairs_BP], dim=1) if self.has_dense else pairs_BP


class CatInteraction(nn.Module):
    """Concatenation: ``[dense, e_1, ..., e_F]`` (dims may differ per table)."""

    def __init__(self, embedding_out_dim: int, dense_dim: int) -> None:
        super().__init__()
        self.out_dim = embedding_out_dim + dense_dim

    def forward(self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor) -> torch.Tensor:
        return pooled_BX if dense_BD is None else torch.cat([dense_BD, pooled_BX], dim=1)
