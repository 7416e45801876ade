"""RMSNorm with fp32 statistics and an optional fused residual add.

The arithmetic lives in archserve.kernels.elementwise (a fused Triton kernel on GPUs,
the torch reference elsewhere); this module holds the weight and the layer API.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.elementwise import rms_norm


class RMSNorm(nn.Module):
    identity_weight = 1.0   # the weight value that leaves a normalised row unchanged

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
        return rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the row is scaled by (1 + weight), in fp32, so a zero weight is
    the identity (checkpoints store the offset from one)."""

    identity_weight = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual, unit_offset=True)
