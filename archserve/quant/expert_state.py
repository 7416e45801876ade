"""Quantized routed experts, from checkpoint tensors to the stacked kernel layout.

The dense linears' two load stages (quant/linear_state.py), applied to one FusedMoE (the
loader walks the model: loader/quantized_model.py):

1. ``attach_expert_quantization`` (before any weight is read): when the checkpoint
   quantizes the experts, each expert's gate, up and down matrix becomes a holder of the
   checkpoint's own tensors for that format (``tensor_layouts``: fp8 weight + scales,
   GPTQ/AWQ qweight/qzeros/scales, compressed-tensors weight_packed ...), registered under
   the checkpoint's names so the model's loader fills them like any parameter. Online
   fp8 keeps the dense stacked weights.
2. ``finalize_quantized_experts`` (after the weights): per expert, gate and up are stacked
   as the fused shards of one layer and repacked by ``to_kernel_weight`` (the dense
   layers' repacking: AWQ nibble order, GPTQ zero points, per-tensor scales per shard ...),
   down likewise; the experts' weights are then stacked (quantized_experts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.moe.quantized_experts import QuantizedExperts, stack_expert_weights
from archserve.quant.checkpoint_matrix import QuantizedMatrix
from archserve.quant.config import ONLINE_FP8, LayerQuant, QuantConfig
from archserve.quant.layouts import (
    check_shard_alignment,
    quantize_fp8_per_channel,
    to_kernel_weight,
)


def _expert_quant(config: QuantConfig, moe_name: str, moe: nn.Module) -> LayerQuant | None:
    """The one quantization of every expert matrix of the layer (None: 16-bit)."""
    names = [f"{moe_name}.{e}.{proj}" for e in range(moe.num_experts)
             for proj in moe.expert_names]
    kinds = {config.layer(name) for name in names}
    if len(kinds) > 1:
        raise ValueError(f"{moe_name}: the checkpoint quantizes its experts' matrices "
                         "differently; one format per layer's experts is loadable")
    return kinds.pop()


def attach_expert_quantization(moe_name: str, moe: nn.Module, config: QuantConfig,
                               device: torch.device, dtype: torch.dtype) -> None:
    """Give one FusedMoE the checkpoint quantizes its checkpoint-tensor holders; give
    a 16-bit one (and online fp8's) its dense weights."""
    quant = _expert_quant(config, moe_name, moe)
    moe.checkpoint_quant = quant
    if quant is None or quant.layout == ONLINE_FP8:
        moe.allocate_dense(device, dtype)
        return
    hidden, inter = moe.hidden_size, moe.intermediate_size
    # A tensor-parallel rank holds its channels of each expert: rows of gate and up,
    # input channels of down (FusedMoE); None at one rank.
    part = ((moe.first_channel, moe.checkpoint_intermediate_size)
            if moe.tp.size > 1 else None)
    for in_features, shards in ((hidden, [inter, inter]), (inter, [hidden])):
        reason = check_shard_alignment(quant, in_features, shards)
        if reason:
            raise ValueError(f"{moe_name} experts: {reason}")
    moe.allocate_dense(torch.device("meta"))
    for e in range(moe.num_stacked_experts):
        expert = getattr(moe, str(e))
        for proj, (rows, k, split) in zip(
                moe.expert_names, ((inter, hidden, "rows"), (inter, hidden, "rows"),
                                   (hidden, inter, "channels")), strict=True):
            matrix = QuantizedMatrix(
                quant, rows, k, device, split_rows=part if split == "rows" else None,
                split_channels=part if split == "channels" else None)
            reason = matrix.split_problem()
            if reason:
                raise ValueError(f"{moe_name} experts: {moe.tp.size} tensor-parallel ranks "
                                 f"cannot split them ({quant.describe()}): {reason}")
            setattr(expert, proj, matrix)


def _fused(gate: QuantizedMatrix, up: QuantizedMatrix) -> dict[str, torch.Tensor]:
    """Gate and up as the two shards of one fused layer (TensorLayout's stacking)."""
    a, b = gate.tensors(), up.tensors()
    out = {}
    for name in a.keys() & b.keys():
        dim = gate.layouts[name].out_dim
        out[name] = (torch.stack([a[name], b[name]]) if dim is None
                     else torch.cat([a[name], b[name]], dim=dim))
    return out


def finalize_quantized_experts(moe: nn.Module, dtype: torch.dtype) -> None:
    """One FusedMoE's quantized experts repacked and stacked (nothing for 16-bit ones)."""
    quant = getattr(moe, "checkpoint_quant", None)
    if quant is None:
        return
    hidden, inter = moe.hidden_size, moe.intermediate_size
    w13, w2 = [], []
    with torch.no_grad():
        for e in range(moe.num_stacked_experts):
            if quant.layout == ONLINE_FP8:
                w13.append(quantize_fp8_per_channel(moe.w13[e]))
                w2.append(quantize_fp8_per_channel(moe.w2[e]))
                continue
            gate, up, down = (getattr(getattr(moe, str(e)), p) for p in moe.expert_names)
            w13.append(to_kernel_weight(quant, _fused(gate, up), [inter, inter], hidden))
            w2.append(to_kernel_weight(quant, down.as_one_shard(), [hidden], inter))
        moe.set_quantized(QuantizedExperts(stack_expert_weights(w13),
                                           stack_expert_weights(w2)), dtype)
