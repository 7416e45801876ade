"""DeepSeek V4's attention layer: a sliding window with sinks over one shared key = value head,
plus compressed entries (CSA: the lightning indexer's top-k of entries compressing 4 tokens
each; HCA: every entry, each compressing 128), and a grouped output projection.

Per token the layer projects:

- the query through a LoRA (``q_a_proj``, ``q_a_norm``, ``q_b_proj``) into heads of
  ``head_dim``, each RMS-normalised without a weight, then rotated;
- one key ``kv_proj`` (``kv_norm``, rotated), which is also the value;
- on compressed layers the compressor's projections (``kv_proj``, ``gate_proj``: two series
  where windows overlap), and on compressed sparse ones the indexer's: its compressor's,
  its query (``q_b_proj`` of the query LoRA's output, rotated) and head weights
  (``weights_proj``, fp32).

Rope rotates interleaved pairs of each head's trailing ``rope_head_dim`` channels: the main
rope (rope_theta) on sliding-window-only layers, the compressed layers' (compress_rope_theta,
YaRN) on the others and on their entries. The value carries the key's rotation, so the
attention output's rope slice is rotated back by the query's position before the output
projection: ``o_a_proj`` maps each of ``o_groups`` groups of heads to ``o_lora_rank``
values (one matrix per group), ``o_b_proj`` the groups' concatenation to the hidden size.

The ``mla_attention`` implementation does the cache work (kernels/compressed_attention/).
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.distributed.parallel_state import get_tp
from archserve.kernels.compressed_attention.interface import (
    CompressedLayerParams,
    CompressedStepInputs,
    CompressorParams,
)
from archserve.kernels.compressed_attention.layout import (
    CSA,
    CompressedCacheLayout,
    ring_cache_index,
)
from archserve.kernels.elementwise import norm_rope_interleaved
from archserve.models.layers.attention import attend_or_record, register_attention_layer
from archserve.models.layers.forward_context import get_forward_context, op_region
from archserve.models.layers.indexer import HeadWeights
from archserve.models.layers.linear import DenseMatrix, Linear
from archserve.models.layers.moe import Router
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.rotary import inverse_frequencies

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


def _fp32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class Compressor(nn.Module):
    """A compressed layer's compressor (``series`` 2 where its windows overlap), or the
    indexer's (``index_heads``: its query and head weights too)."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, series: int, eps: float,
                 index_heads: int = 0, q_lora_rank: int = 0) -> None:
        super().__init__()
        # DeepSeek's release keeps these 16-bit beside its fp8 projections (transformers
        # keeps them out of the fp8 conversion): a router's kind of matrix, which no
        # checkpoint or online quantization reaches, timed by the decode GEMM tuner as one.
        self.kv_proj = Router(series * head_dim, hidden_size)
        self.gate_proj = Router(series * head_dim, hidden_size)
        self.position_bias = _fp32(rate, series * head_dim)
        self.kv_norm = RMSNorm(head_dim, eps)
        if index_heads:
            self.q_b_proj = Linear(q_lora_rank, index_heads * head_dim)
            self.scorer = nn.Module()
            self.scorer.weights_proj = HeadWeights(index_heads, hidden_size)


class DeepseekV4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dims = config.compressed_attention
        assert dims is not None
        if get_tp().size > 1:
            raise ValueError("DeepSeek V4 runs on one tensor-parallel rank in this build")
        self.layer_index = layer_index
        self.layer_key = register_attention_layer(self)
        self.ring_index = ring_cache_index(config.num_layers, layer_index)
        self.kind = dims.layer_kinds[layer_index]
        self.rate = dims.rate(layer_index)
        h, d, hidden = config.num_heads, config.head_dim, config.hidden_size
        self.num_heads, self.head_dim, self.rope_dim = h, d, dims.rope_head_dim
        self.window, self.eps = dims.sliding_window, config.rms_norm_eps
        self.q_a_proj = Linear(hidden, dims.q_lora_rank)
        self.q_a_norm = RMSNorm(dims.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(dims.q_lora_rank, h * d)
        self.kv_proj = Linear(hidden, d)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_groups, self.o_lora_rank = dims.o_groups, dims.o_lora_rank
        # One [o_lora_rank, H d / o_groups] matrix per group, read by the layer itself (a
        # grouped GEMM), so in the model dtype (a quantized checkpoint's is dequantized).
        self.o_a_proj = DenseMatrix(dims.o_groups * dims.o_lora_rank, h * d // dims.o_groups)
        self.o_b_proj = Linear(dims.o_groups * dims.o_lora_rank, hidden)
        self.sinks = _fp32(h)
        sparse = self.kind == CSA
        self.compressor = None
        if self.rate:
            self.compressor = Compressor(hidden, d, self.rate, 2 if sparse else 1,
                                         config.rms_norm_eps)
            if sparse:
                self.compressor.indexer = Compressor(
                    hidden, dims.index_head_dim, self.rate, 2, config.rms_norm_eps,
                    index_heads=dims.index_n_heads, q_lora_rank=dims.q_lora_rank)
        self.index_topk = dims.index_topk if sparse else 0
        self.index_heads, self.index_dim = dims.index_n_heads, dims.index_head_dim
        theta, scaling = ((dims.compress_rope_theta, dims.compress_rope_scaling) if self.rate
                          else (config.rope_theta, None))
        self.register_buffer("inv_freq", inverse_frequencies(self.rope_dim, theta, scaling),
                             persistent=False)
        self._layouts: dict[int, CompressedCacheLayout] = {}

    # ---- what the implementation is handed ----------------------------------------------
    def layout(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> CompressedCacheLayout:
        block_size = kv_cache.shape[2]
        layout = self._layouts.get(block_size)
        if layout is None or layout.dtype != dtype:
            indexer = self.index_dim if self.index_topk else 0
            layout = self._layouts[block_size] = CompressedCacheLayout(
                block_size, self.head_dim, self.window, self.rate, bool(self.index_topk),
                indexer, dtype)
        return layout

    def params(self) -> CompressedLayerParams:
        compressor = None
        c = self.compressor
        if c is not None:
            indexer = getattr(c, "indexer", None)
            compressor = CompressorParams(
                self.rate, indexer is not None, c.position_bias, c.kv_norm.weight,
                indexer.position_bias if indexer is not None else None,
                indexer.kv_norm.weight if indexer is not None else None)
        return CompressedLayerParams(self.window, self.head_dim, self.rope_dim,
                                     self.head_dim ** -0.5, self.sinks, self.eps,
                                     self.inv_freq, compressor, self.index_topk)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] (the normalised block input) -> [T, hidden_size]."""
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        q_resid = self.q_a_norm(self.q_a_proj(hidden))[0]
        q = norm_rope_interleaved(self.q_b_proj(q_resid).view(t, h, d), positions,
                                  self.inv_freq, eps=self.eps)
        kv = norm_rope_interleaved(self.kv_proj(hidden), positions, self.inv_freq,
                                   self.kv_norm.weight, self.kv_norm.eps)
        inputs = CompressedStepInputs(q, kv)
        c = self.compressor
        if c is not None:
            inputs.compressor_kv, inputs.compressor_gate = c.kv_proj(hidden), c.gate_proj(hidden)
            indexer = getattr(c, "indexer", None)
            if indexer is not None:
                inputs.index_kv = indexer.kv_proj(hidden)
                inputs.index_gate = indexer.gate_proj(hidden)
                iq = indexer.q_b_proj(q_resid).view(t, self.index_heads, self.index_dim)
                inputs.index_query = norm_rope_interleaved(iq, positions, self.inv_freq)
                inputs.index_weights = indexer.scorer.weights_proj(hidden).float() * (
                    (self.index_heads * self.index_dim) ** -0.5)
        # The fields as they are (dataclasses.astuple would copy the tensors).
        out = attend_or_record(self, *(getattr(inputs, f.name) for f in fields(inputs)))
        out = norm_rope_interleaved(out, positions, self.inv_freq, inverse=True)
        return self.o_b_proj(self._grouped_output(out.reshape(t, self.o_groups, -1)))

    def attend(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        """The cache writes (window ring, compressor, indexer keys) and attention of a
        step, eagerly: ``inputs`` CompressedStepInputs' fields -> [T, H, head_dim]."""
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_index]
        step = CompressedStepInputs(*inputs)
        with op_region("attention"):
            return ctx.attn_impl.forward_compressed(
                self.layout(cache, step.kv.dtype), self.params(), step, cache,
                ctx.kv_caches[self.ring_index], ctx.attn_metadata)

    def attended_shape(self, query: torch.Tensor, *rest: torch.Tensor | None) -> torch.Tensor:
        return torch.empty_like(query)

    def _grouped_output(self, grouped: torch.Tensor) -> torch.Tensor:
        """[T, groups, H d / groups] -> [T, groups * o_lora_rank]: each group's matrix."""
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)
        return torch.einsum("tgi,goi->tgo", grouped, w).reshape(grouped.shape[0], -1)
