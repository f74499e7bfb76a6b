"""A stack of Linear layers with ReLU between them (and optionally after the last)."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self,
        in_dim: int,
        widths: list[int],
        final_activation: bool,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for i, w in enumerate(widths):
            linear = nn.Linear(d, w, device=device)
            # Reference DLRM init: W ~ N(0, sqrt(2 / (fan_in + fan_out))), b ~ N(0, sqrt(1 / fan_out)).
            with torch.no_grad():
                linear.weight.copy_(
                    torch.randn(w, d, generator=generator) * math.sqrt(2.0 / (d + w))
                )
                linear.bias.copy_(torch.randn(w, generator=generator) * math.sqrt(1.0 / w))
            layers.append(linear)
            if i < len(widths) - 1 or final_activation:
                # In place: the Linear's backward does not need its output, and ReLU's
                # backward reads only its own result, so no extra [B, width] buffer.
                layers.append(nn.ReLU(inplace=True))
            d = w
        self.layers = nn.Sequential(*layers)
        self.out_dim = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
