"""A quantized checkpoint's two load steps over a whole model.

Before any weight is read, every layer the checkpoint quantizes gets a holder of the
checkpoint's own tensors: a linear its ``QuantizedLinearState``, a FusedMoE one
``QuantizedMatrix`` per expert matrix, a ``DenseMatrix`` (MLA's kv_b_proj) a
``QuantizedDenseMatrix``; the other layers get their dense weights. After the weights, each
holder is repacked into its kernel layout, or for a DenseMatrix dequantized. Finding the
layers takes the model's layer classes, so the walk is the loader's; what one layer holds
and how it is repacked is archserve.quant's.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.models.layers.linear import DenseMatrix, Linear
from archserve.models.layers.moe import FusedMoE
from archserve.quant.checkpoint_matrix import QuantizedDenseMatrix, dense_matrix_holder
from archserve.quant.config import QuantConfig
from archserve.quant.expert_state import attach_expert_quantization, finalize_quantized_experts
from archserve.quant.linear_state import (
    attach_linear_quantization,
    finalize_quantized_layers,
    materialise_weight,
)


def attach_quantization(model: nn.Module, config: QuantConfig, device: torch.device,
                        dtype: torch.dtype) -> None:
    """The checkpoint's holders in every layer it quantizes (the model was built under
    ``deferred_linear_weights``); dense weights everywhere else."""
    for hf_names, layer in _fused_linears(model):
        attach_linear_quantization(hf_names, layer, config, device, dtype)
    for module in model.modules():     # linears outside the checkpoint map (none today)
        if isinstance(module, Linear) and module.quant is None:
            materialise_weight(module, device, dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            attach_expert_quantization(name, module, config, device, dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, DenseMatrix):
            holder = dense_matrix_holder(name, module, config, device)
            if holder is not None:
                _replace(model, name, holder)


def finalize_quantization(model: nn.Module, dtype: torch.dtype) -> None:
    """After the weights: every holder of ``attach_quantization`` in its kernel layout."""
    finalize_quantized_layers(model)
    for module in model.modules():
        if isinstance(module, FusedMoE):
            finalize_quantized_experts(module, dtype)
    for name, holder in list(model.named_modules()):
        if isinstance(holder, QuantizedDenseMatrix):
            dense = DenseMatrix(holder.rows, holder.in_features, split_rows=holder.split_rows)
            with torch.no_grad():
                dense.weight = nn.Parameter(holder.dequantized().to(dtype),
                                            requires_grad=False)
            _replace(model, name, dense)


def _fused_linears(model: nn.Module) -> list[tuple[list[str], nn.Module]]:
    """Each linear layer with the checkpoint matrices fused into it (q/k/v, gate/up)."""
    by_layer: dict[int, tuple[list[str], nn.Module]] = {}
    for hf_name, (layer, _shard) in model.linear_checkpoint_modules().items():
        by_layer.setdefault(id(layer), ([], layer))[0].append(hf_name)
    return list(by_layer.values())


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
