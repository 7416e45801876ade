"""The contract between a DeepSeek V4 attention layer and its ``mla_attention`` implementation.

The layer projects this step's tokens (queries, the shared key = value, and on compressed
layers the compressor's and the indexer's projections) and hands them over with its
constants; the implementation updates the layer's cache blocks (layout.py: the compressor's
state, the entries of groups that complete) and its ring (the window's keys, at the
tokens' ``slot_mapping``), selects each query's
compressed entries (all of them before the query on heavily compressed layers, the
indexer's top-k on compressed sparse ones), attends over the window and those entries with
the layer's sinks, and returns the per-head output [T, H, head_dim], its rope slice still
rotated (the layer rotates it back).

Rope, here and in the layer, rotates interleaved pairs of each head's trailing
``rope_dim`` channels (DeepSeek's layout) by the angles position * inv_freq (fp32), computed
where they are used (kernels/elementwise/reference.py, ``rotate_interleaved``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.compressed_attention.layout import CompressedCacheLayout


@dataclass
class CompressorParams:
    """One compressed layer's compressor (and, on a compressed sparse layer, its indexer's)."""

    rate: int
    overlap: bool                          # two series: entry g mixes groups g - 1 and g
    position_bias: torch.Tensor            # [rate, series * head_dim] fp32
    norm_weight: torch.Tensor              # [head_dim]
    index_position_bias: torch.Tensor | None = None   # [rate, series * index_dim] fp32
    index_norm_weight: torch.Tensor | None = None     # [index_dim]


@dataclass
class CompressedLayerParams:
    window: int
    head_dim: int
    rope_dim: int
    scale: float
    sinks: torch.Tensor                    # [H] fp32, in the units of the scaled scores
    eps: float                             # the compressor norms' epsilon
    inv_freq: torch.Tensor                 # the layer's rope, fp32 [rope_dim / 2]
    compressor: CompressorParams | None = None        # None: sliding window only
    index_topk: int = 0                    # compressed sparse layers

    @property
    def rate(self) -> int:
        return self.compressor.rate if self.compressor is not None else 0

    @property
    def index_dim(self) -> int:
        c = self.compressor
        return 0 if c is None or c.index_norm_weight is None else c.index_norm_weight.shape[0]


@dataclass
class CompressedStepInputs:
    query: torch.Tensor                    # [T, H, head_dim], normed and rotated
    kv: torch.Tensor                       # [T, head_dim]: the key, also the value
    compressor_kv: torch.Tensor | None = None     # [T, series * head_dim], projections
    compressor_gate: torch.Tensor | None = None   # [T, series * head_dim]
    index_kv: torch.Tensor | None = None          # [T, series * index_dim]
    index_gate: torch.Tensor | None = None        # [T, series * index_dim]
    index_query: torch.Tensor | None = None       # [T, index_heads, index_dim], rotated
    index_weights: torch.Tensor | None = None     # [T, index_heads] fp32, scales folded in


class CompressedAttentionImpl(Protocol):
    def forward_compressed(self, layout: CompressedCacheLayout, layer: CompressedLayerParams,
                           inputs: CompressedStepInputs, kv_cache: torch.Tensor,
                           ring_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """-> the heads' output [T, H, head_dim] in the query's dtype."""
        ...
