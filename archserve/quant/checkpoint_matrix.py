"""One matrix held as the checkpoint stores it, for modules that are not ``Linear``.

``QuantizedMatrix`` registers a quantized matrix's checkpoint tensors (``tensor_layouts``:
fp8 weight + scales, packed integers ...) under the checkpoint's names, so the model's
loader fills it like any parameter; the quantized experts (quant/expert_state.py) hold each
expert's gate, up and down this way.

Some matrices a layer reads itself rather than multiplying through a linear kernel: MLA
absorbs ``kv_b_proj`` into its query and output (models/layers/mla.py), so it is a
``DenseMatrix``. When the checkpoint quantizes one (DeepSeek-V3's block-FP8 release does),
the loader puts a ``dense_matrix_holder`` in its place before loading and dequantizes it
to the model dtype afterwards (loader/quantized_model.py), with the dense layers' own
repacking and dequantization (``to_kernel_weight``, ``dequantize``).
Online fp8 and GGUF leave such a matrix dense, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.linear.quantized_weights import dequantize
from archserve.quant.config import GGUF, ONLINE_FP8, LayerQuant, QuantConfig
from archserve.quant.layouts import (
    TensorLayout,
    channels_part,
    channels_split_problem,
    rows_part,
    rows_split_problem,
    tensor_layout,
    tensor_layouts,
    to_kernel_weight,
)


class QuantizedMatrix(nn.Module):
    """One [rows, in_features] matrix as the checkpoint stores it. A tensor-parallel rank
    holds part of it: output rows [first, first + rows) of ``whole`` (``split_rows``: an
    expert's gate and up) or input channels [first, first + in_features) of ``whole``
    (``split_channels``: its down); it answers the loader with the checkpoint's whole
    shapes and keeps its entries of each tensor (quant/layouts.py, ``rows_part``)."""

    def __init__(self, quant: LayerQuant, rows: int, in_features: int,
                 device: torch.device, split_rows: tuple[int, int] | None = None,
                 split_channels: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.quant, self.rows, self.in_features = quant, rows, in_features
        self.split_rows, self.split_channels = split_rows, split_channels
        self.layouts: dict[str, TensorLayout] = {
            t.name: t for t in tensor_layouts(quant, in_features)}
        self.loaded: set[str] = set()
        for name, t in self.layouts.items():
            self.register_parameter(name, nn.Parameter(
                torch.zeros(t.shape(rows), dtype=t.dtype, device=device), requires_grad=False))

    def split_problem(self) -> str | None:
        """Why this rank's part is not whole packed words, groups and blocks, else None."""
        if self.split_rows is not None:
            first, whole = self.split_rows
            return rows_split_problem(self.quant, self.in_features, first, self.rows, whole)
        if self.split_channels is not None:
            first, whole = self.split_channels
            return channels_split_problem(self.quant, whole, first, self.in_features)
        return None

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        if self.split_rows is not None:
            return self.layouts[param].shape(self.split_rows[1])
        if self.split_channels is not None:
            return tensor_layout(self.quant, self.split_channels[1], param).shape(self.rows)
        return self.layouts[param].shape(self.rows)

    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        target = getattr(self, param)
        if self.split_rows is not None:
            first, whole = self.split_rows
            tensor = rows_part(self.layouts[param], tensor, first, self.rows, whole)
        elif self.split_channels is not None:
            first, whole = self.split_channels
            tensor = channels_part(self.layouts[param], tensor, first, self.in_features, whole)
        with torch.no_grad():
            target.copy_(tensor.reshape(target.shape))
        self.loaded.add(param)

    def optional(self, param: str) -> bool:
        layout = self.layouts.get(param)
        return layout is not None and layout.optional

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name, layout in self.layouts.items()
                if name in self.loaded or not layout.optional}

    def as_one_shard(self) -> dict[str, torch.Tensor]:
        """``tensors()`` as a layer of one fused shard (per-shard values stacked)."""
        return {name: t.unsqueeze(0) if self.layouts[name].out_dim is None else t
                for name, t in self.tensors().items()}

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, in_features]."""
        return dequantize(to_kernel_weight(self.quant, self.as_one_shard(), [self.rows],
                                           self.in_features))


class QuantizedDenseMatrix(QuantizedMatrix):
    """A ``DenseMatrix``'s stand-in while its quantized checkpoint tensors load."""


def dense_matrix_holder(name: str, matrix: nn.Module, config: QuantConfig,
                        device: torch.device) -> QuantizedDenseMatrix | None:
    """A holder of the checkpoint's tensors to put in place of one ``DenseMatrix`` (rows x
    in_features ``matrix.weight``), or None where the checkpoint leaves it dense."""
    quant = config.layer(name)
    if quant is None or quant.layout in (ONLINE_FP8, GGUF):
        return None
    rows, cols = matrix.weight.shape
    holder = QuantizedDenseMatrix(quant, rows, cols, device, split_rows=matrix.split_rows)
    reason = holder.split_problem()
    if reason:
        raise ValueError(f"{name}: its tensor-parallel part cannot be cut from the "
                         f"checkpoint ({quant.describe()}): {reason}")
    return holder
