"""DCNv2 low-rank cross layers (Wang et al., "DCN V2", WWW 2021), as MLPerf DLRMv2 uses them::

    x0 = [dense, e_1, ..., e_F]                       [B, d]   (d = dense dim + sum_f D_f)
    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l        V_l: [r, d], U_l: [d, r], b_l: [d]
    out = x_L                                         [B, d]   -> the top MLP

Each layer is a rank-r factorisation of the full cross layer ``x0 * (W_l x_l + b_l) + x_l``
(W = U V): two GEMMs of B x d x r instead of one of B x d x d. The GEMMs are torch's
(``addmm``), which on a CPU run at the machine's GEMM rate already; the elementwise part
is one fused ``addcmul`` per layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class DCNv2Interaction(nn.Module):
    def __init__(
        self,
        embedding_out_dim: int,
        dense_dim: int,
        num_layers: int,
        rank: int,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        d = embedding_out_dim + dense_dim
        self.in_dim = self.out_dim = d
        self.num_layers, self.rank = num_layers, rank
        self.V = nn.ParameterList()
        self.U = nn.ParameterList()
        self.b = nn.ParameterList()
        for _ in range(num_layers):
            # Glorot-uniform factors (as the reference), zero bias.
            v, u = torch.empty(rank, d), torch.empty(d, rank)
            v.uniform_(-math.sqrt(6 / (d + rank)), math.sqrt(6 / (d + rank)), generator=generator)
            u.uniform_(-math.sqrt(6 / (d + rank)), math.sqrt(6 / (d + rank)), generator=generator)
            self.V.append(nn.Parameter(v.to(device)))
            self.U.append(nn.Parameter(u.to(device)))
            self.b.append(nn.Parameter(torch.zeros(d, device=device)))

    def forward(self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor) -> torch.Tensor:
        b = pooled_BX.shape[0]
        pooled = pooled_BX.reshape(b, -1)
        x0 = pooled if dense_BD is None else torch.cat([dense_BD, pooled.to(dense_BD.dtype)], 1)
        x = x0
        for v, u, bias in zip(self.V, self.U, self.b):
            low = torch.mm(x, v.t().to(x.dtype))  # [B, r]
            x = torch.addcmul(x, x0, torch.addmm(bias.to(x.dtype), low, u.t().to(x.dtype)))
        return x
