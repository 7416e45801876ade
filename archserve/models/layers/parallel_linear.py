"""Tensor-parallel forms of the linear layers: column-parallel (each rank computes some
output columns) and row-parallel (each rank reduces over some input columns, then the
ranks all-reduce).

The loader protocol is unchanged: ``shard_shape`` answers with the checkpoint's whole
shape and ``load_shard`` takes the whole checkpoint tensor, keeping this rank's part. At
one rank the layers are exactly their plain counterparts. q/k/v split by heads, with each
KV head replicated on the ranks whose query heads read it when there are fewer KV heads
than ranks (``distributed.layout.split_heads``).
"""

from __future__ import annotations

import torch

from archserve.distributed.layout import split_evenly, split_heads
from archserve.distributed.parallel_state import get_tp
from archserve.models.layers.linear import GateUpLinear, Linear, QKVLinear, apply_linear
from archserve.quant.config import GGUF, ONLINE_FP8, LayerQuant
from archserve.quant.layouts import (
    TensorLayout,
    channels_part,
    channels_split_problem,
    rows_part,
    rows_split_problem,
    tensor_layout,
)


def _checkpoint_layout(layer: Linear, param: str, in_features: int) -> TensorLayout | None:
    """The layout of one of a quantized layer's checkpoint tensors, for ``in_features``
    input channels (None: a dense tensor, as online fp8 loads; and the bias)."""
    quant = layer.quant
    if quant is None or param == "bias" or not quant.layouts:
        return None
    return tensor_layout(quant.quant, in_features, param)


def _unsplittable(quant: LayerQuant) -> str | None:
    """Why no layer in this format splits over ranks, whatever its shape (None: it may)."""
    if quant.layout == GGUF:
        # Its blocks are decoded per matrix as they arrive (quant/gguf_blocks.py), not
        # through the tensor layouts a rank's part is cut by.
        return "GGUF-quantized layers do not split: run this checkpoint with tensor_parallel_size=1"
    return None


class _ColumnParallel:
    """Mixin for a merged linear: each checkpoint matrix (shard) contributes the rows
    ``[first_rows[i], first_rows[i] + shard_rows()[i])`` of its ``checkpoint_rows[i]``;
    a quantized one, the entries of each of its tensors that cover those rows."""

    checkpoint_rows: list[int]
    first_rows: list[int]

    def split_problem(self, quant: LayerQuant) -> str | None:
        """Why this layer's rows, quantized as ``quant``, cannot split as the ranks need."""
        if self.tp.size == 1 or quant.layout == ONLINE_FP8:
            return None
        reason = _unsplittable(quant)
        if reason:
            return reason
        for i, rows in enumerate(self.shard_rows()):
            reason = rows_split_problem(quant, self.in_features, self.first_rows[i], rows,
                                        self.checkpoint_rows[i])
            if reason:
                return reason
        return None

    def shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        local = self.local_shard_shape(shard, param)
        if self.tp.size == 1:
            return local
        i = self.shard_names.index(shard)
        layout = _checkpoint_layout(self, param, self.in_features)
        if layout is not None:
            return layout.shape(self.checkpoint_rows[i])
        return (self.checkpoint_rows[i], *local[1:])

    def load_shard(self, shard: str | None, param: str, tensor: torch.Tensor) -> None:
        if self.tp.size > 1:
            i = self.shard_names.index(shard)
            first, rows, whole = self.first_rows[i], self.shard_rows()[i], self.checkpoint_rows[i]
            layout = _checkpoint_layout(self, param, self.in_features)
            tensor = (rows_part(layout, tensor, first, rows, whole) if layout is not None
                      else tensor.narrow(0, first, rows))
        super().load_shard(shard, param, tensor)


class ColumnParallelLinear(_ColumnParallel, Linear):
    """One linear whose output rows split over the ranks: this rank holds rows
    ``[first_row, first_row + rows)`` of ``out_features`` (MLA splits its query by heads)."""

    def __init__(self, in_features: int, out_features: int, first_row: int, rows: int,
                 bias: bool = False) -> None:
        self.tp = get_tp()
        super().__init__(in_features, rows, bias)
        self.checkpoint_rows = [out_features]
        self.first_rows = [first_row]


class QKVParallelLinear(_ColumnParallel, QKVLinear):
    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.tp = tp = get_tp()
        self.heads = split_heads(num_heads, num_kv_heads, tp.size, tp.rank)
        super().__init__(hidden_size, head_size, self.heads.num_heads, self.heads.num_kv_heads,
                         bias)
        self.checkpoint_rows = [num_heads * head_size] + [num_kv_heads * head_size] * 2
        self.first_rows = [self.heads.first_head * head_size] + \
            [self.heads.first_kv_head * head_size] * 2


class GateUpParallelLinear(_ColumnParallel, GateUpLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        self.tp = tp = get_tp()
        first, per = split_evenly(intermediate_size, tp.size, tp.rank)
        super().__init__(hidden_size, per, bias)
        self.checkpoint_rows = [intermediate_size] * 2
        self.first_rows = [first] * 2


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the partial products are all-reduced, then the
    bias (held whole by every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = tp = get_tp()
        first, per = split_evenly(in_features, tp.size, tp.rank)
        super().__init__(per, out_features, bias)
        self.checkpoint_in_features = in_features
        self.first_column = first

    def split_problem(self, quant: LayerQuant) -> str | None:
        """Why this layer's input channels, quantized as ``quant``, cannot split."""
        if self.tp.size == 1 or quant.layout == ONLINE_FP8:
            return None
        return _unsplittable(quant) or channels_split_problem(
            quant, self.checkpoint_in_features, self.first_column, self.in_features)

    def shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        local = self.local_shard_shape(shard, param)
        if self.tp.size == 1 or param == "bias":
            return local
        layout = _checkpoint_layout(self, param, self.checkpoint_in_features)
        if layout is not None:
            return layout.shape(self.out_features)
        return (local[0], self.checkpoint_in_features)

    def load_shard(self, shard: str | None, param: str, tensor: torch.Tensor) -> None:
        if self.tp.size > 1 and param != "bias":
            layout = _checkpoint_layout(self, param, self.checkpoint_in_features)
            tensor = (channels_part(layout, tensor, self.first_column, self.in_features,
                                    self.checkpoint_in_features) if layout is not None
                      else tensor.narrow(1, self.first_column, self.in_features))
        super().load_shard(shard, param, tensor)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """As ``Linear.forward_add`` on one rank; None on several (the add follows the
        all-reduce)."""
        return super().forward_add(x, residual) if self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        partial = (self.quant(x, None) if self.quant is not None
                   else apply_linear(x, self.weight, None))
        # An adapter's delta over this rank's input columns is a partial sum too: it joins
        # the reduction.
        out = self.tp.all_reduce(self.add_lora(x, partial))
        return out if self.bias is None else out + self.bias
