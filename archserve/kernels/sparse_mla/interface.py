"""The contract between a sparse-MLA (DSA) layer and its ``mla_attention`` implementation.

On top of the dense contract (kernels/mla/interface.py: the split query, the latent, W_UK and
W_UV), a sparse layer hands over its lightning indexer's view of this step's tokens, or,
where it reuses an earlier layer's selection (GLM-5's shared layers), that layer's top-k.
The implementation writes the latent and the indexer key into the layer's cache row
(layout.py), selects each query row's ``topk`` keys, attends over them, and returns the
per-head output with the selection, which a later layer may reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from archserve.kernels.attention.interface import AttentionMetadata


@dataclass
class IndexerInputs:
    """The lightning indexer of this step's tokens."""

    query: torch.Tensor      # [T, index_heads, index_head_dim], rotated, model dtype
    key: torch.Tensor        # [T, index_head_dim], normed and rotated: goes into the cache
    weights: torch.Tensor    # [T, index_heads] fp32, every scale folded in


class SparseMlaImpl(Protocol):
    def forward_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float, topk: int,
                       indexer: IndexerInputs | None = None,
                       shared_indices: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (per-head values [T, H, v], int32 [T, topk] selected positions, -1 padded).
        ``indexer`` None: ``shared_indices`` is the selection, and no key is written."""
        ...
