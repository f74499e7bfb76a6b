"""DCNv2 low-rank cross layers (Wang et al., "DCN V2", WWW 2021), as MLPerf DLRMv2 uses them::

    x0 = [dense, e_1, ..., e_F]                       [B, d]   (d = dense dim + sum_f D_f)
    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l        V_l: [r, d], U_l: [d, r], b_l: [d]
    out = x_L                                         [B, d]   -> the top MLP

Each layer is a rank-r factorisation of the full cross layer ``x0 * (W_l x_l + b_l) + x_l``
(W = U V): two GEMMs of B x d x r instead of one of B x d x d.

On a CPU in fp32 all layers run as one autograd node (:class:`_CrossStack`): its GEMMs go
to the faster library for each product (:mod:`recscale.modules.gemm`: oneDNN for
``x V^T``, ``low U^T + b``, ``g U`` and ``g + low' V``; MKL for the weight gradients) and
its backward touches each ``[B, d]`` tensor fewer times than autograd's chain of
``addcmul``/``addmm`` nodes (at MLPerf's shapes one such tensor is 16,384 x 3,456 fp32 =
226 MB): ``gx0 += g * y`` in place, ``g * x0`` written over ``y`` (no longer needed),
``g + dlow V`` fused into the GEMM. Elsewhere (CUDA, autocast) the plain torch ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recscale.modules import gemm


class _CrossStack(torch.autograd.Function):
    """``x0 [B, d] -> x_L [B, d]`` through layers ``(V_l [r, d], U_l [d, r], b_l [d])``.

    Saved: ``x_l`` (the input of each layer: V's gradient), ``low_l = x_l V_l^T``
    ``[B, r]`` (U's gradient) and ``y_l = low_l U_l^T + b_l`` (x0's gradient) - what
    autograd keeps for the plain path too.
    """

    @staticmethod
    def forward(ctx, x0, keep: bool, *params):
        """``keep``: grad mode at the call (False inside ``torch.no_grad()``, where nothing
        is saved: an evaluation batch of 8,192 through 1,000 layers held 31 GB of them)."""
        vs, us, bs = params[0::3], params[1::3], params[2::3]
        saved = []
        x = x0
        for v, u, b in zip(vs, us, bs):
            low = gemm.linear(x, v)  # [B, r]
            y = gemm.linear(low, u, b)  # [B, d]
            if keep:
                saved += [x, low, y]
            x = torch.addcmul(x, x0, y)
        ctx.save_for_backward(x0, *saved, *params)
        ctx.num_layers = len(vs)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # Writes over its saved y: one backward per forward (no retain_graph re-runs).
        x0, *rest = ctx.saved_tensors
        n = ctx.num_layers
        acts, params = rest[: 3 * n], rest[3 * n :]
        grads: list[torch.Tensor | None] = [None] * (3 * n)
        g = grad_out
        gx0 = None
        for li in range(n - 1, -1, -1):
            x, low, y = acts[3 * li : 3 * li + 3]
            v, u = params[3 * li], params[3 * li + 1]
            # x_{l+1} = x0 * y + x:  d x0 += g * y,  d y = g * x0,  d x = g (+ via low)
            if gx0 is None:
                gx0 = g * y
            else:
                gx0.addcmul_(g, y)
            gy = torch.mul(g, x0, out=y)  # y is spent: its memory takes d y
            # dU [d, r] and db [d] in one pass; dV [r, d]
            grads[3 * li + 1], grads[3 * li + 2] = gemm.weight_grad(gy, low, bias_grad=True)
            dlow = gemm.linear(gy, u.t())  # [B, r]
            grads[3 * li] = gemm.weight_grad(dlow, x)[0]
            g = gemm.linear(dlow, v.t(), add=g)  # d x_l = g + dlow V
        gx0.add_(g)  # x_0 is x0 itself
        return (gx0, None, *grads)


class DCNv2Interaction(nn.Module):
    def __init__(
        self,
        embedding_out_dim: int,
        dense_dim: int,
        num_layers: int,
        rank: int,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
        fused: bool = True,
    ) -> None:
        """``fused``: the one-node CPU path (:class:`_CrossStack`); False keeps the plain
        torch ops everywhere (the reference path, ``model.kernels=torch``)."""
        super().__init__()
        self.fused = fused
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
        if (
            self.fused
            and x0.device.type == "cpu"
            and x0.dtype == torch.float32
            and not torch.is_autocast_enabled(x0.device.type)
        ):
            params = [p for layer in zip(self.V, self.U, self.b) for p in layer]
            return _CrossStack.apply(x0, torch.is_grad_enabled(), *params)
        x = x0
        for v, u, bias in zip(self.V, self.U, self.b):
            low = torch.mm(x, v.t().to(x.dtype))  # [B, r]
            x = torch.addcmul(x, x0, torch.addmm(bias.to(x.dtype), low, u.t().to(x.dtype)))
        return x
