"""MLA prefill in the expanded form: the latent turned into per-head keys and values, then
the standard Triton prefill kernel (kernels/attention/triton_prefill.py).

Absorbed attention costs (L + R) + L multiply-adds per query-key pair and head (1088 for
DeepSeek), the expanded form (nope + R) + v (320): for a prompt attending to itself the
expansion (once per context token) is soon paid back. Each prefilling sequence's whole
context, cached prefix included, is read from the latent cache, expanded with W_UK / W_UV
and laid out contiguously in a scratch paged cache of one block per EXPANDED_BLOCK tokens;
the prefill kernel then runs causally over it as over any cache. Values are zero-padded to
the key head size (the kernel has one head size; the padded columns are dropped).

This runs in eager steps only (a step with a prompt is never a CUDA graph), so it may read
the host copies of the lengths. The scratch cache holds 2 x H x (nope + R) values per
context token: DeepSeek-V3 (128 heads) needs about 96 KiB per token, so a long cached
prefix costs memory in proportion (vLLM bounds it with a workspace and chunks the context;
not done here yet).
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.triton_prefill import prefill_attention

EXPANDED_BLOCK = 16


def gather_latent(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                  k_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Every context row of the given sequences, in order, as ``dtype`` [sum(seq_lens), L+R]."""
    block_size = kv_cache.shape[2]
    seq_index = np.repeat(np.arange(len(seq_lens)), seq_lens)
    positions = np.concatenate([np.arange(n) for n in seq_lens])
    device = kv_cache.device
    seq_t = torch.from_numpy(seq_index).to(device)
    pos_t = torch.from_numpy(positions).to(device)
    blocks = block_tables[seq_t, pos_t // block_size].long()
    offsets = pos_t % block_size
    # Indexed by block and offset: the latent may be a view of wider rows (sparse MLA's).
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Index the bytes: float8 indexing is not implemented on every device.
        rows = kv_cache.view(torch.uint8)[0, blocks, offsets, 0].view(kv_cache.dtype)
        return (rows.float() * k_scale).to(dtype)
    return kv_cache[0, blocks, offsets, 0].to(dtype)


def expanded_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                     w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                     k_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of the rows of some sequences (back to back, ``query_lens`` each, the
    last of ``seq_lens`` positions) over their latent contexts -> [T, H, v]."""
    num_heads, nope, kv_rank = w_uk.shape
    v_head, rope = w_uv.shape[1], q_pe.shape[-1]
    head = max(nope + rope, v_head)
    dtype, device = q_nope.dtype, q_nope.device
    latent = gather_latent(kv_cache, block_tables, seq_lens, k_scale, dtype)

    blocks = [-(-n // EXPANDED_BLOCK) for n in seq_lens]
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    rows = np.concatenate([first_block[i] * EXPANDED_BLOCK + np.arange(n)
                           for i, n in enumerate(seq_lens)])
    rows_t = torch.from_numpy(rows).to(device)
    scratch = torch.zeros(2, sum(blocks) * EXPANDED_BLOCK, num_heads, head, dtype=dtype,
                          device=device)
    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, head - x.shape[-1])) if x.shape[-1] < head else x

    keys = torch.cat((torch.einsum("nl,hdl->nhd", latent[:, :kv_rank], w_uk),
                      latent[:, None, kv_rank:].expand(-1, num_heads, -1)), -1)
    scratch[0].index_copy_(0, rows_t, padded(keys))
    values = torch.einsum("nl,hvl->nhv", latent[:, :kv_rank], w_uv)
    scratch[1].index_copy_(0, rows_t, padded(values))

    tables = np.full((len(seq_lens), max(blocks)), 0, dtype=np.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = first_block[i] + np.arange(n)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    query = padded(torch.cat((q_nope, q_pe.to(dtype)), -1)).contiguous()
    out = torch.empty_like(query)
    prefill_attention(query, scratch.view(2, -1, EXPANDED_BLOCK, num_heads, head),
                      torch.from_numpy(tables).to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device),
                      torch.from_numpy(starts).to(device), out, num_seqs=len(seq_lens),
                      max_query_len=max(query_lens), scale=scale)
    return out[..., :v_head]
