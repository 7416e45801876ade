"""Dense linear layers, and the fused forms that merge several checkpoint matrices into one.

Every layer computes through ``apply_linear``, a module-level routine: a selected linear
backend installs its GEMM with ``set_linear_routine`` and every model picks it up without
knowing the backend. Fusing q/k/v (and gate/up) at load time turns three (two) GEMM
launches per layer into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from archserve.kernels.elementwise import silu_and_mul

LinearRoutine = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_routine: LinearRoutine = F.linear


def set_linear_routine(routine: LinearRoutine | None) -> None:
    """Install the GEMM every ``Linear`` uses; None restores ``torch.nn.functional.linear``."""
    global _routine
    _routine = routine if routine is not None else F.linear


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    return _routine(x, weight, bias)


def apply_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of x times a gate-then-up weight [2I, K] -> [.., I].

    A routine that can fuse the activation into its GEMM provides ``linear_silu_mul``;
    otherwise this is the GEMM, then the SiLU kernel.
    """
    fused = getattr(_routine, "linear_silu_mul", None)
    if fused is not None:
        return fused(x, weight, bias)
    return silu_and_mul(_routine(x, weight, bias))


class Linear(nn.Module):
    """y = x W^T + b with W stored [out_features, in_features] like a checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Uninitialised on purpose: a loader (real or dummy) always fills it.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears sharing one input, stored as row blocks of one weight.

    ``shard_names`` name the blocks in checkpoint order (e.g. q, k, v) so a loader can
    copy each checkpoint matrix into its block with ``load_shard``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False) -> None:
        if len(output_sizes) != len(shard_names):
            raise ValueError("output_sizes and shard_names differ in length")
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self._offsets = offsets

    def shard_slice(self, shard: str) -> slice:
        i = self.shard_names.index(shard)
        return slice(self._offsets[i], self._offsets[i + 1])

    def shard_shape(self, shard: str, param: str) -> tuple[int, ...]:
        rows = self.output_sizes[self.shard_names.index(shard)]
        return (rows, self.in_features) if param == "weight" else (rows,)

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (``param`` is "weight" or "bias") into its block."""
        target = getattr(self, param)
        expected = self.shard_shape(shard, param)
        if target is None or tuple(tensor.shape) != expected:
            got = "a tensor" if target is None else f"shape {tuple(tensor.shape)}"
            raise ValueError(f"{shard} {param}: expected shape {expected}, got {got}")
        with torch.no_grad():
            target[self.shard_slice(shard)].copy_(tensor)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a merged output [.., sum(sizes)] into the per-shard outputs."""
        return list(y.split(self.output_sizes, dim=-1))


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size,
                         [num_heads * head_size, num_kv_heads * head_size,
                          num_kv_heads * head_size],
                         ["q", "k", "v"], bias)


class GateUpLinear(MergedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], ["gate", "up"], bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [.., intermediate_size]: the gated MLP's activation, fused into
        the GEMM where the routine can."""
        return apply_linear_silu_mul(x, self.weight, self.bias)
