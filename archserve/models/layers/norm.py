"""RMSNorm with fp32 statistics and an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normed, new_residual); with ``residual``, normalise x + residual.

        The new residual is the un-normalised input (x itself when no residual was given),
        which is what the next block adds its output to: a decoder layer can write
        ``h, residual = norm(h, residual)`` for both its first and later layers.
        """
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before the weight multiply, as the HF reference does, so bf16 results agree.
        return self.weight * x32.to(dtype), x
