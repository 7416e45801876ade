"""Random quantized experts in each layout the MoE kernels read, for the kernel tests."""

from __future__ import annotations

import torch

from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
    FP8_DTYPE,
    Fp8Weight,
    IntGroupWeight,
    pack_int_rows,
)
from archserve.kernels.moe.quantized_experts import QuantizedExperts, stack_expert_weights
from archserve.quant.layouts import quantize_fp8_per_channel

# mode -> what the experts hold (the formats real checkpoints ship)
MODES = ("fp8_token", "fp8_static", "fp8_block", "fp8_weight_only", "int4_sym_g32",
         "int4_asym_g64", "int8_channel")


def _weight(mode: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    if mode.startswith("fp8") and mode != "fp8_block":
        q = quantize_fp8_per_channel(w)
        activation = {"fp8_token": ACT_DYNAMIC_TOKEN, "fp8_static": ACT_STATIC_TENSOR,
                      "fp8_weight_only": ACT_NONE}[mode]
        q.activation = activation
        if activation == ACT_STATIC_TENSOR:
            q.input_scale = torch.rand((), generator=gen) * 0.02 + 0.01
        return q
    if mode == "fp8_block":
        nb, kb = -(-n // 128), -(-k // 128)
        scale = (torch.rand(nb, kb, generator=gen) + 0.5) / (100 * k ** 0.5)
        values = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
        return Fp8Weight(values, scale, ACT_DYNAMIC_GROUP, block=(128, 128))
    bits = 8 if mode.startswith("int8") else 4
    group = {"int4_sym_g32": 32, "int4_asym_g64": 32 if k < 64 else 64, "int8_channel": k}[mode]
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) + 0.5) / (k ** 0.5 * (1 << bits))
    offsets = None
    if "asym" in mode:
        offsets = -torch.randint(0, 1 << bits, (k // group, n), generator=gen) * scales
    weight = IntGroupWeight(pack_int_rows(q, bits), scales, offsets, bits, group, k, n)
    weight.validate()
    return weight


def quantized_experts(mode: str, experts: int, hidden: int, inter: int, seed: int = 0,
                      device: str = "cpu") -> QuantizedExperts:
    gen = torch.Generator().manual_seed(seed * 131 + experts + hidden)
    w13 = [_weight(mode, 2 * inter, hidden, gen) for _ in range(experts)]
    w2 = [_weight(mode, hidden, inter, gen) for _ in range(experts)]
    stacked = QuantizedExperts(stack_expert_weights(w13), stack_expert_weights(w2))
    return QuantizedExperts(*(_to(w, device) for w in (stacked.w13, stacked.w2)))


def _to(w, device: str):  # noqa: ANN001, ANN202
    import dataclasses
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).to(device)
                                     for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})
