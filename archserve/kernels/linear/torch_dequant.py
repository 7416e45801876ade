"""TORCH_DEQUANT: a quantized layer's weight dequantized once, at start-up, to the model's
dtype; every call is then a torch matmul.

The path of every scheme on CPUs (and of any device where no quantized kernel runs). It
keeps the checkpoint's weights exactly (the dequantization is the reference one) but not
the memory saving. A W8A8 checkpoint's activations are still quantized as its scheme says
(per token, per 128-group or with its static scale, fp8 or int8), so the products are
those of the W8A8 kernels, computed in floating point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from archserve.kernels.linear.quantized_weights import (
    ACT_NONE,
    Fp8Weight,
    IntGroupWeight,
    QuantizedWeight,
    dequantize,
    dequantize_activation,
    quantize_activation_fp8,
    quantize_activation_int8,
)


@dataclass
class DequantizedWeight:
    weight: torch.Tensor                   # [N, K] in the model dtype, x's channel order
    activation: str = ACT_NONE             # how the checkpoint quantizes activations
    input_scale: torch.Tensor | None = None
    fp8_activations: bool = True           # else int8


class TorchDequantLinear:
    def __init__(self, device=None, spec=None) -> None:
        pass

    def prepare(self, weight: QuantizedWeight, dtype: torch.dtype) -> DequantizedWeight:
        dense = dequantize(weight)
        if isinstance(weight, IntGroupWeight) and weight.perm is not None:
            reordered = torch.empty_like(dense)
            reordered[:, weight.perm] = dense      # x[:, perm] @ W^T == x @ W'^T
            dense = reordered
        return DequantizedWeight(dense.to(dtype), getattr(weight, "activation", ACT_NONE),
                                 getattr(weight, "input_scale", None),
                                 isinstance(weight, Fp8Weight))

    def __call__(self, x: torch.Tensor, weight: DequantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.activation != ACT_NONE:
            shape = x.shape
            flat = x.reshape(-1, shape[-1])
            quantize = quantize_activation_fp8 if weight.fp8_activations else \
                quantize_activation_int8
            flat = dequantize_activation(*quantize(flat, weight.activation, weight.input_scale))
            x = flat.to(x.dtype).reshape(shape)
        return F.linear(x, weight.weight, bias)
