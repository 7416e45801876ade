"""DeepSeek's lightning indexer (DSA): what a sparse-MLA layer hands its attention to choose
each query's ``index_topk`` keys.

Per token the indexer projects the query LoRA's normalised output through ``wq_b`` into
``index_n_heads`` query heads of ``index_head_dim``, and the layer's input through ``wk``
and a LayerNorm into one key; both carry RoPE on their first ``qk_rope_head_dim`` values
(the two halves, DeepSeek-V3.2; interleaved pairs, GLM-5, de-interleaved here as the MLA
layer does). ``weights_proj`` gives each head a weight per token, kept in fp32 as
transformers keeps it. A key's score for a query is

    sum_h  w_h / sqrt(heads * head_dim) * relu(q_h . k)

(transformers scales q.k before the ReLU; a positive scale passes through it). DeepSeek's
reference rotates q and k by a Hadamard matrix before quantizing them to fp8; dot products
are unchanged by it, so a 16-bit cache needs none (as transformers).

Every tensor-parallel rank holds the whole indexer: its selection must be every rank's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from archserve.kernels.sparse_mla.interface import IndexerInputs
from archserve.models.layers.linear import Linear
from archserve.models.layers.moe import Router
from archserve.models.layers.norm_folding import float_matrices
from archserve.models.layers.rotary import RotaryEmbedding, deinterleave

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig

INDEXER_NORM_EPS = 1e-6


class KeyNorm(nn.Module):
    """LayerNorm (weight and bias) of the indexer key, computed in fp32."""

    def __init__(self, width: int, eps: float = INDEXER_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(width), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class HeadWeights(Router):
    """weights_proj: a router's kind of matrix (one weight per head and token, fp32 weights
    in a 16-bit model too, as transformers keeps them, never quantized, as vLLM builds it
    without a quant config), so the decode GEMM tuner times it as it times a router."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__(num_heads, hidden_size, dtype=torch.float32)


class LightningIndexer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dims, mla = config.sparse_attention, config.mla
        assert dims is not None and mla is not None and mla.q_lora_rank
        self.num_heads, self.head_dim = dims.index_n_heads, dims.index_head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.rope_interleaved = dims.indexer_rope_interleaved
        self.wq_b = Linear(mla.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = KeyNorm(self.head_dim)
        self.weights_proj = HeadWeights(self.num_heads, config.hidden_size)
        self.weight_scale = (self.num_heads * self.head_dim) ** -0.5

    def reader_matrices(self) -> list[torch.Tensor] | None:
        """The matrices that read the layer's input (norm_folding.py), or None."""
        return float_matrices(self.wk, self.weights_proj)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                rotary: RotaryEmbedding) -> IndexerInputs:
        """hidden [T, hidden_size] (the layer's normalised input), q_resid [T, q_lora_rank]
        (the query LoRA's normalised output)."""
        t, r = hidden.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden))
        q_pe, q_rest = q.split([r, self.head_dim - r], dim=-1)
        k_pe, k_rest = k.split([r, self.head_dim - r], dim=-1)
        if self.rope_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rotary(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        query = torch.cat((q_pe.view(t, self.num_heads, r), q_rest), dim=-1)
        key = torch.cat((k_pe, k_rest), dim=-1)
        weights = self.weights_proj(hidden).float() * self.weight_scale
        return IndexerInputs(query=query, key=key, weights=weights)
