"""DeepSeek sparse attention (DSA) in plain PyTorch: the lightning indexer, the per-query top-k
and the absorbed MLA over the selected latent rows. The oracle of the Triton kernels and the
CPU path (TORCH_REFERENCE).

A query row at position p sees keys 0..p (its context). The indexer scores each of them,

    score(p, s) = sum_h  w[p, h] * relu(q[p, h] . k[s])        (w holds every scale)

and the row attends to its ``topk`` best-scored keys. A row with no more than ``topk`` keys
attends to all of them: it is exactly dense MLA (transformers' top-k of
min(index_topk, keys) over the causal scores selects every key there). Indices are token
positions of the row's sequence, valid entries first, then -1.
"""

from __future__ import annotations

import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.reference import scheduled_sequences
from archserve.kernels.sparse_mla.layout import (
    SparseMlaLayout,
    read_index_keys,
    read_latent,
    sequence_slots,
)


def index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
                 ) -> torch.Tensor:
    """query [Q, H, D], weights [Q, H], keys [S, D] -> fp32 scores [Q, S]."""
    products = torch.einsum("qhd,sd->qhs", query.float(), keys.float())
    return torch.einsum("qh,qhs->qs", weights.float(), products.clamp_min(0))


def select_topk(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [Q, S] (row q sees its first ``lengths[q]`` keys) -> int32 [Q, topk]: every
    key of a row that sees at most ``topk``, else its ``topk`` best; -1 after them."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    for q, length in enumerate(lengths.tolist()):
        if length <= topk:
            out[q, :length] = torch.arange(length, dtype=torch.int32, device=scores.device)
        else:
            out[q] = scores[q, :length].topk(topk).indices.to(torch.int32)
    return out


def sparse_topk(layout: SparseMlaLayout, kv_cache: torch.Tensor, meta: AttentionMetadata,
                query: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
    """The indexer over the cached keys (this step's written): int32 [T, topk] positions."""
    block_size = kv_cache.shape[2]
    out = torch.full((query.shape[0], topk), -1, dtype=torch.int32, device=query.device)
    for i, start, end, seq_len in scheduled_sequences(meta):
        lengths = torch.arange(seq_len - (end - start), seq_len, device=query.device) + 1
        if int(lengths.max()) <= topk:          # dense: no scores needed
            out[start:end] = select_topk(query.new_empty(end - start, 0), lengths, topk)
            continue
        slots = sequence_slots(meta.block_tables[i], torch.arange(seq_len, device=query.device),
                               block_size)
        scores = index_scores(query[start:end], weights[start:end],
                              read_index_keys(layout, kv_cache, slots))
        out[start:end] = select_topk(scores, lengths, topk)
    return out


def sparse_attend(layout: SparseMlaLayout, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  query: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA of each query row [T, H, L + R] over its selected latent rows ->
    [T, H, L] in query's dtype."""
    block_size, L = kv_cache.shape[2], layout.kv_lora_rank
    out = torch.zeros(*query.shape[:2], L, dtype=query.dtype, device=query.device)
    for i, start, end, _ in scheduled_sequences(meta):
        for row in range(start, end):
            positions = indices[row][indices[row] >= 0]
            latent = read_latent(layout, kv_cache,
                                 sequence_slots(meta.block_tables[i], positions, block_size))
            scores = torch.einsum("hd,kd->hk", query[row].float(), latent) * scale
            out[row] = (torch.softmax(scores, -1) @ latent[:, :L]).to(query.dtype)
    return out
