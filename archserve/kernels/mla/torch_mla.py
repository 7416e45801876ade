"""TORCH_REFERENCE for ``mla_attention``: DeepSeek's latent attention over a latent paged cache.

The cache of one layer is ``[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``:
per token the normalised KV latent ``c_kv`` followed by the rotated rope key ``k_pe``, shared
by every head. The model absorbs ``W_UK`` into the query and applies ``W_UV`` after attention
(archserve/models/layers/mla.py), so attention here is multi-query attention over the latent:

    q [T, H, L + R] . cache [S, L + R]  ->  softmax  ->  @ cache[:, :L]  ->  [T, H, L]

Both prefill and decode take this absorbed path (plain fp32 torch, one loop over sequences):
exact, and it reads only the latent, so chunked prefill over a cached prefix and preemption
need nothing else. TRITON_MLA (kernels/mla/triton_mla.py) is tested against ``attend_latent``.
Sparse MLA (DeepSeek-V3.2, GLM-5) takes ``forward_sparse``: the cache row holds the indexer
key beside the latent, and kernels/sparse_mla/reference.py selects and attends. DeepSeek
V4's compressed attention takes ``forward_compressed`` (kernels/compressed_attention/).
"""

from __future__ import annotations

from typing import Any

import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.reference import (
    attention_mask,
    gather_plane,
    scheduled_sequences,
    write_kv_cache,
)
from archserve.kernels.compressed_attention import reference as compressed
from archserve.kernels.compressed_attention.interface import (
    CompressedLayerParams,
    CompressedStepInputs,
)
from archserve.kernels.compressed_attention.layout import CompressedCacheLayout
from archserve.kernels.mla.interface import absorb_query, latent_output_to_heads
from archserve.kernels.sparse_mla.interface import IndexerInputs
from archserve.kernels.sparse_mla.layout import SparseMlaLayout, write_rows
from archserve.kernels.sparse_mla.reference import sparse_attend, sparse_topk


class TorchMlaImpl:
    graph_capturable = False      # reads sequence lengths on the host

    def __init__(self, device: Any = None, spec: Any = None,
                 layout: SparseMlaLayout | None = None) -> None:
        self.device = device
        self.spec = spec
        # A sparse model's cache rows (kernels/sparse_mla/layout.py): from the spec, or given.
        # (DeepSeek V4's layers hand their own layout to forward_compressed.)
        if (layout is None and getattr(spec, "mla_sparse", False)
                and getattr(spec, "compress_rate", None) is None):
            layout = SparseMlaLayout.for_spec(spec)
        self.layout = layout

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                w_uv: torch.Tensor, scale: float, k_scale: float = 1.0) -> torch.Tensor:
        """The MlaImpl contract (kernels/mla/interface.py): absorbed, every step."""
        write_kv_cache(latent[:, None, :], None, kv_cache, meta.slot_mapping, k_scale)
        out = self.attend_latent(absorb_query(q_nope, q_pe, w_uk), kv_cache, meta, scale,
                                 w_uk.shape[-1], k_scale)
        return latent_output_to_heads(out, w_uv)

    def attend_latent(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, kv_lora_rank: int,
                      k_scale: float = 1.0) -> torch.Tensor:
        """query [T, H, L+R] (absorbed nope part, then rope part) over the cached latent
        (this step's rows already written) -> [T, H, L] in query's dtype."""
        out = torch.empty(*query.shape[:2], kv_lora_rank, dtype=query.dtype,
                          device=query.device)
        for i, q_start, q_end, seq_len in scheduled_sequences(meta):
            kv = gather_plane(kv_cache, 0, meta.block_tables[i], seq_len, k_scale)[:, 0]
            q = query[q_start:q_end].float()                       # [Q, H, L+R]
            scores = torch.einsum("qhd,kd->hqk", q, kv) * scale
            mask = attention_mask(q_end - q_start, seq_len, None, query.device)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[q_start:q_end] = torch.einsum("hqk,kl->qhl", probs,
                                              kv[:, :kv_lora_rank]).to(query.dtype)
        return out

    def forward_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float, topk: int,
                       indexer: IndexerInputs | None = None,
                       shared_indices: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The SparseMlaImpl contract (kernels/sparse_mla/interface.py), in fp32 torch."""
        layout = self.layout
        assert layout is not None, "a sparse-MLA layer needs the impl built for its spec"
        write_rows(layout, kv_cache, meta.slot_mapping, latent,
                   indexer.key if indexer is not None else None)
        indices = (shared_indices if indexer is None else
                   sparse_topk(layout, kv_cache, meta, indexer.query, indexer.weights, topk))
        out = sparse_attend(layout, kv_cache, meta, absorb_query(q_nope, q_pe, w_uk), indices,
                            scale)
        return latent_output_to_heads(out, w_uv), indices

    def forward_compressed(self, layout: CompressedCacheLayout, layer: CompressedLayerParams,
                           inputs: CompressedStepInputs, kv_cache: torch.Tensor,
                           ring_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The CompressedAttentionImpl contract (kernels/compressed_attention/interface.py)."""
        return compressed.forward_compressed(layout, layer, inputs, kv_cache, ring_cache, meta)
