"""The contract between an MLA layer and its ``mla_attention`` implementation.

The layer hands over this step's tokens in DeepSeek's split form and the two halves of
``kv_b_proj`` (W_UK [H, nope, L] and W_UV [H, v, L]); the implementation writes the latent
(``c_kv | k_pe``, one row per token) into the one-plane cache and returns the per-head
attention output [T, H, v]. How it gets there is its own choice: over the latent with W_UK
absorbed into the query and W_UV applied after (what decode wants: it reads only the latent),
or with the latent expanded to per-head keys and values (what a long prefill wants: fewer
FLOPs per query-key pair).
"""

from __future__ import annotations

from typing import Protocol

import torch

from archserve.kernels.attention.interface import AttentionMetadata

# A sequence that brings at most this many query tokens (a speculative verification's
# k + 1, a short prompt chunk) runs absorbed, each token a decode row of its own causal
# length (decode_rows.py): it reads only the latent, where the expanded form first expands
# the sequence's whole context to per-head keys and values (DeepSeek-V3: 128 heads x 256
# values a cached token, ~33 MFLOP, against ~0.28 MFLOP a query-key pair absorbed), which a
# few rows cannot repay. vLLM's MLA decode backends take spec-decode queries as decode rows
# alike. Such steps are what an MLA target's mixed-step graphs capture.
DECODE_ROWS_MAX_QUERY_LEN = 16


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[T, H, nope], [T, H, rope] -> the query over the latent [T, H, L + rope]."""
    return torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe.to(q_nope.dtype)), -1)


def latent_output_to_heads(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output over the latent [T, H, L] -> per-head values [T, H, v]."""
    return torch.einsum("thl,hvl->thv", out, w_uv)


class MlaImpl(Protocol):
    graph_capturable: bool

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                w_uv: torch.Tensor, scale: float, k_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, L + rope] -> [T, H, v]."""
        ...
