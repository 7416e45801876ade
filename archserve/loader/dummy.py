"""Dummy weights: real shapes, random values, made directly on the target device.

For benchmarks and tests of real model shapes without a checkpoint. Small uniform values
keep activations finite through dozens of layers; norms are the identity. A quantized
layer's checkpoint tensors get random bits (packed integers), values in [-1, 1] (fp8
weights) and small scales (MXFP4: small e8m0 exponents), so its dequantized weight is as
small as a dense one.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.linear.quantized_weights import E8M0_BIAS


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: int = 0) -> None:
    generator_device = next(model.parameters()).device
    generator = torch.Generator(device=generator_device).manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            # Gemma's norms scale by (1 + weight): their identity is 0.
            owner = modules[name.rpartition(".")[0]]
            param.fill_(getattr(owner, "identity_weight", 1.0))
        elif param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            values = torch.empty(param.shape, device=param.device)
            param.copy_(values.uniform_(-1.0, 1.0, generator=generator))
        elif param.is_floating_point():
            # uniform_ in the parameter's own dtype and device: no host round trip.
            param.uniform_(low, high, generator=generator)
        elif name.endswith(".scales") and param.dtype == torch.uint8:
            # MXFP4's e8m0 exponents: 2**-13 to 2**-11, so its e2m1 values (up to 6) make
            # weights of the dense ones' size.
            param.random_(E8M0_BIAS - 13, E8M0_BIAS - 10, generator=generator)
        elif param.dtype in (torch.int32, torch.int8, torch.uint8) and param.dim() == 2:
            info = torch.iinfo(param.dtype)
            param.random_(info.min, info.max, generator=generator)
