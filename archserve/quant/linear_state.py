"""The state of one quantized linear layer, from checkpoint tensors to a running kernel.

Three stages, each done once:

1. ``attach_linear_quantization`` (loader, before any weight is read): every linear layer
   the checkpoint quantizes gets a ``QuantizedLinearState`` as ``layer.quant``, holding
   empty tensors shaped as the checkpoint stores them (fused shards stacked).
2. ``finalize_quantized_layers`` (loader, after the weights): the checkpoint tensors are
   repacked into the kernels' layout (an IntGroupWeight, Fp8Weight or Int8Weight).
3. ``install_kernel`` (engine start-up): the selected backend prepares the weight for its
   kernel (a transpose, a dense copy on CPUs ...) and runs every call after that.

Whatever the layer holds at each stage is registered as its parameters, so memory
accounting and the roofline count the bytes that are really there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from archserve.kernels.linear.quantized_weights import QuantizedWeight
from archserve.quant.config import GGUF, ONLINE_FP8, LayerQuant, QuantConfig
from archserve.quant.layouts import (
    TensorLayout,
    check_shard_alignment,
    gguf_weight,
    tensor_layouts,
    to_kernel_weight,
)


class QuantizedLinearState:
    def __init__(self, layer: nn.Module, quant: LayerQuant, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.quant = quant
        self.rows = layer.shard_rows()
        self.in_features = layer.in_features
        self.dtype = dtype
        self.weight: QuantizedWeight | None = None
        self.kernel: Any = None
        self.prepared: Any = None
        self.kernel_name = ""
        self.layouts: dict[str, TensorLayout] = (
            {} if quant.layout in (ONLINE_FP8, GGUF)
            else {t.name: t for t in tensor_layouts(quant, layer.in_features)})
        self.loaded: set[str] = set()
        self._layer_ref = layer
        self.device = device
        # GGUF: each shard's weight as it arrives (integer groups, or a dense tensor for
        # the types not kept quantized); types may differ between the fused shards.
        self.gguf_parts: list[Any] = [None] * len(self.rows)
        if self.layouts:
            _set_params(layer, {
                name: torch.zeros(t.stored_shape(self.rows), dtype=t.dtype, device=device)
                for name, t in self.layouts.items()})

    # ---- the loader protocol (models.layers.linear.LinearQuantState) ------------------------
    def checkpoint_params(self) -> list[str]:
        return list(self.layouts) or ["weight"]

    def optional(self, param: str) -> bool:
        layout = self.layouts.get(param)
        return layout is not None and layout.optional

    def shard_shape(self, shard: int, param: str) -> tuple[int, ...]:
        if not self.layouts:
            return (self.rows[shard], self.in_features)
        return self.layouts[param].shape(self.rows[shard])

    def load_shard(self, shard: int, param: str, tensor: torch.Tensor) -> None:
        if self.quant.layout == GGUF:
            self.gguf_parts[shard] = tensor
            self.loaded.add(param)
            return
        layer = self._layer_ref
        storage = getattr(layer, param)
        with torch.no_grad():
            if not self.layouts:                         # online fp8: a dense weight
                start = sum(self.rows[:shard])
                storage[start:start + self.rows[shard]].copy_(tensor)
            else:
                layout = self.layouts[param]
                if layout.out_dim is None:
                    storage[shard].copy_(tensor.reshape(storage.shape[1:]))
                else:
                    per = layout.rows_per_entry
                    start = sum(self.rows[:shard]) // per
                    length = math.ceil(self.rows[shard] / per)
                    storage.narrow(layout.out_dim, start, length).copy_(
                        tensor.reshape(storage.narrow(layout.out_dim, start, length).shape))
        self.loaded.add(param)

    # ---- after loading ------------------------------------------------------------------
    def finalize(self) -> None:
        """Repack the checkpoint tensors into the kernels' layout (once, after loading)."""
        layer = self._layer_ref
        if self.quant.layout == GGUF:
            self.weight = gguf_weight(self.gguf_parts, self.in_features, self.device)
            self.gguf_parts = []
            if isinstance(self.weight, torch.Tensor):      # some shard is not kept quantized
                _set_params(layer, {"weight": self.weight.to(self.dtype)})
                layer.quant = None                         # a dense layer from here on
            else:
                _set_params(layer, _tensors_of(self.weight))
            return
        names = self.checkpoint_params()
        tensors = {name: getattr(layer, name) for name in names
                   if name in self.loaded or not self.layouts or not self.optional(name)}
        with torch.no_grad():
            self.weight = to_kernel_weight(self.quant, tensors, self.rows, self.in_features)
        _set_params(layer, _tensors_of(self.weight), remove=names)

    def install_kernel(self, name: str, kernel: Any) -> None:
        """Run every call through ``kernel`` (a backend's impl), after its ``prepare``."""
        layer = self._layer_ref
        prepare = getattr(kernel, "prepare", None)
        with torch.no_grad():
            self.prepared = prepare(self.weight, self.dtype) if prepare else self.weight
        _set_params(layer, _tensors_of(self.prepared), remove=list(_tensors_of(self.weight)))
        self.kernel, self.kernel_name = kernel, name
        self.weight = None                               # the prepared form replaces it

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError("a quantized linear layer ran before a kernel was installed "
                               "(archserve.engine.decode_gemms.install_linear_route does it)")
        return self.kernel(x, self.prepared, bias)


def _tensors_of(value: Any) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {"weight": value}
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                if isinstance(getattr(value, f.name), torch.Tensor)}
    return {}


def _set_params(layer: nn.Module, tensors: dict[str, torch.Tensor],
                remove: list[str] | tuple[str, ...] = ("weight",)) -> None:
    for name in remove:
        if name in layer._parameters:
            del layer._parameters[name]
    for name, tensor in tensors.items():
        if name in layer._parameters:
            del layer._parameters[name]
        setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


# ---- one layer's load steps (the loader walks the model: loader/quantized_model.py) ---------

def attach_linear_quantization(hf_names: list[str], layer: nn.Module, config: QuantConfig,
                               device: torch.device, dtype: torch.dtype) -> None:
    """Give one linear layer (the checkpoint matrices ``hf_names`` fused into it) its
    QuantizedLinearState where the checkpoint quantizes it, else its dense weight.

    The model was built under ``deferred_linear_weights`` (dense weights on "meta"). Raises
    ValueError when fused shards (q/k/v) are quantized differently or cannot share one
    tensor.
    """
    kinds = {config.layer(name) for name in hf_names}
    if len(kinds) > 1:
        raise ValueError(f"{', '.join(hf_names)} are fused into one layer but the "
                         "checkpoint quantizes them differently")
    quant = kinds.pop()
    # A tensor-parallel rank's part must be whole packed words, groups and blocks.
    split_problem = getattr(layer, "split_problem", None)
    reason = split_problem(quant) if quant is not None and split_problem else None
    if reason:
        raise ValueError(f"{', '.join(hf_names)}: {layer.tp.size} tensor-parallel ranks "
                         f"cannot split this layer ({quant.describe()}): {reason}")
    if quant is not None:
        reason = check_shard_alignment(quant, layer.in_features, layer.shard_rows())
        if reason:
            raise ValueError(f"{', '.join(hf_names)}: {reason}")
    if quant is None:
        materialise_weight(layer, device, dtype)
        return
    if quant.layout in (ONLINE_FP8, GGUF):
        materialise_weight(layer, device, dtype)
    layer.quant = QuantizedLinearState(layer, quant, device, dtype)


def materialise_weight(layer: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """A dense weight left on "meta" by ``deferred_linear_weights``, allocated for loading."""
    weight = layer._parameters.get("weight")
    if weight is not None and weight.is_meta:
        layer.weight = nn.Parameter(torch.empty(weight.shape, device=device, dtype=dtype),
                                    requires_grad=False)


def quantized_layers(model: nn.Module) -> list[tuple[str, QuantizedLinearState]]:
    return [(name, m.quant) for name, m in model.named_modules()
            if isinstance(getattr(m, "quant", None), QuantizedLinearState)]


def finalize_quantized_layers(model: nn.Module) -> None:
    for _name, state in quantized_layers(model):
        state.finalize()
