"""Random paged sparse-MLA problems: the kernel tests' and the numerics canary's.

A case is the standard attention case's batch (kernels/attention/cases.py: shuffled block
tables, (query_len, seq_len) per sequence) over a sparse-MLA cache (kernels/sparse_mla/layout.py): every
cached position holds a random latent and indexer key, this step's rows are handed over as
the layer hands them (the latent, the indexer's query, key and weights, the split query,
W_UK and W_UV). Random continuous scores leave no ties for the top-k to break.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archserve.kernels.attention.cases import make_case
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.mla.interface import absorb_query
from archserve.kernels.sparse_mla.interface import IndexerInputs
from archserve.kernels.sparse_mla.layout import SparseMlaLayout, sequence_slots, write_rows


@dataclass
class SparseMlaCase:
    layout: SparseMlaLayout
    kv_cache: torch.Tensor          # the cached prefix written, this step's rows not
    meta: AttentionMetadata
    q_nope: torch.Tensor            # [T, H, nope]
    q_pe: torch.Tensor              # [T, H, rope]
    latent: torch.Tensor            # [T, L + rope]
    indexer: IndexerInputs
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    topk: int
    num_valid_tokens: int

    @property
    def absorbed_query(self) -> torch.Tensor:
        return absorb_query(self.q_nope, self.q_pe, self.w_uk)

    def written_cache(self) -> torch.Tensor:
        """A copy of the cache with this step's rows written too (as the impls write them)."""
        cache = self.kv_cache.clone()
        write_rows(self.layout, cache, self.meta.slot_mapping, self.latent, self.indexer.key)
        return cache

    def run(self, impl) -> tuple[torch.Tensor, torch.Tensor]:
        """(output rows of real tokens [T, H, v], their selected positions: None where the
        implementation ran the step dense)."""
        cache = self.kv_cache.clone()
        out, indices = impl.forward_sparse(self.q_nope, self.q_pe, self.latent, cache,
                                           self.meta, self.w_uk, self.w_uv, self.scale,
                                           self.topk, self.indexer)
        n = self.num_valid_tokens
        return out[:n], None if indices is None else indices[:n]


def make_sparse_case(seqs: list[tuple[int, int]], *, topk: int, num_heads: int = 16,
                     kv_lora_rank: int = 32, rope: int = 16, nope: int = 16, v_head: int = 16,
                     index_heads: int = 8, index_dim: int = 32, block_size: int = 16,
                     dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                     index_cache_dtype: str = "auto", pad_tokens: int = 0,
                     device: str = "cpu", seed: int = 0) -> SparseMlaCase:
    """``seqs``: (query_len, seq_len) per sequence, as for make_case."""
    base = make_case(seqs, num_heads=1, num_kv_heads=1, head_size=16, block_size=block_size,
                     pad_tokens=pad_tokens, seed=seed)
    layout = SparseMlaLayout.for_cache(kv_lora_rank, rope, index_dim, dtype, kv_cache_dtype,
                                       index_cache_dtype)
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    meta = base.meta
    cache = layout.allocate(base.kv_cache.shape[1], block_size)
    for i, (query_len, seq_len) in enumerate(seqs):     # the cached prefix
        slots = sequence_slots(meta.block_tables[i], torch.arange(seq_len - query_len),
                               block_size)
        write_rows(layout, cache, slots, randn(len(slots), kv_lora_rank + rope),
                   randn(len(slots), index_dim))
    num_tokens = meta.slot_mapping.shape[0]
    indexer = IndexerInputs(
        query=randn(num_tokens, index_heads, index_dim).to(device),
        key=randn(num_tokens, index_dim).to(device),
        weights=(torch.randn(num_tokens, index_heads, generator=gen)
                 * (index_heads * index_dim) ** -0.5).to(device))
    meta = AttentionMetadata.from_lengths(meta.query_lens_cpu, meta.seq_lens_cpu,
                                          meta.block_tables, meta.slot_mapping, device)
    return SparseMlaCase(
        layout=layout, kv_cache=cache.to(device), meta=meta,
        q_nope=randn(num_tokens, num_heads, nope).to(device),
        q_pe=randn(num_tokens, num_heads, rope).to(device),
        latent=randn(num_tokens, kv_lora_rank + rope).to(device), indexer=indexer,
        w_uk=randn(num_heads, nope, kv_lora_rank, std=kv_lora_rank ** -0.5).to(device),
        w_uv=randn(num_heads, v_head, kv_lora_rank, std=kv_lora_rank ** -0.5).to(device),
        scale=(nope + rope) ** -0.5, topk=topk, num_valid_tokens=sum(q for q, _ in seqs))
