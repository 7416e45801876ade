"""Dummy weights: real shapes, random values, made directly on the target device.

For benchmarks and tests of real model shapes without a checkpoint. Small uniform values
keep activations finite through dozens of layers; norms keep their ones.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: int = 0) -> None:
    generator_device = next(model.parameters()).device
    generator = torch.Generator(device=generator_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.is_floating_point():
            # uniform_ in the parameter's own dtype and device: no host round trip.
            param.uniform_(low, high, generator=generator)
