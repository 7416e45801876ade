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


def _refuse_quantized(layer: Linear) -> None:
    if layer.quant is not None:
        raise ValueError("tensor parallelism does not split quantized linear layers yet "
                         "(their scales and groups would have to follow the split): run a "
                         "quantized checkpoint with tensor_parallel_size=1")


class _ColumnParallel:
    """Mixin for a merged linear: each checkpoint matrix (shard) contributes the rows
    ``[first_rows[i], first_rows[i] + shard_rows()[i])`` of its ``checkpoint_rows[i]``."""

    checkpoint_rows: list[int]
    first_rows: list[int]

    def shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        local = self.local_shard_shape(shard, param)
        if self.tp.size == 1:
            return local
        _refuse_quantized(self)
        return (self.checkpoint_rows[self.shard_names.index(shard)], *local[1:])

    def load_shard(self, shard: str | None, param: str, tensor: torch.Tensor) -> None:
        if self.tp.size > 1:
            _refuse_quantized(self)
            i = self.shard_names.index(shard)
            tensor = tensor.narrow(0, self.first_rows[i], self.shard_rows()[i])
        super().load_shard(shard, param, tensor)


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

    def shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        local = self.local_shard_shape(shard, param)
        if self.tp.size == 1 or param == "bias":
            return local
        _refuse_quantized(self)
        return (local[0], self.checkpoint_in_features)

    def load_shard(self, shard: str | None, param: str, tensor: torch.Tensor) -> None:
        if self.tp.size > 1 and param != "bias":
            _refuse_quantized(self)
            tensor = tensor.narrow(1, self.first_column, self.in_features)
        super().load_shard(shard, param, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        partial = (self.quant(x, None) if self.quant is not None
                   else apply_linear(x, self.weight, None))
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias
