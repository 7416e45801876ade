"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.elementwise import silu_and_mul


class SiluAndMul(nn.Module):
    """x [.., 2I] (gate then up, as GateUpLinear stores them) -> silu(gate) * up [.., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
