"""TORCH_REFERENCE: plain PyTorch paged attention, the oracle every other backend is tested against.

Written for clarity, not speed: one loop over sequences, fp32 math, explicit masks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from archserve.kernels.attention.interface import (
    AttentionLayerParams,
    AttentionMetadata,
    PagedAttentionImpl,
)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter this step's keys/values into the paged cache; slot -1 is skipped. A cache of
    one plane (an MLA latent) takes ``key`` only (``value`` None)."""
    planes, num_blocks, block_size = kv_cache.shape[:3]
    flat = kv_cache.view(planes, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    if slots.numel() == 0:
        return
    cache_dtype = kv_cache.dtype
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for i, (src, scale) in enumerate(((key, k_scale), (value, v_scale))[:planes]):
        src = src[valid]
        if fp8:
            # index_copy_ has no float8 kernel on every device: scatter the bytes instead.
            quantized = (src.float() / scale).to(cache_dtype)
            flat[i].view(torch.uint8).index_copy_(0, slots, quantized.view(torch.uint8))
        else:
            flat[i].index_copy_(0, slots, src.to(cache_dtype))


def gather_plane(kv_cache: torch.Tensor, plane: int, block_table: torch.Tensor, seq_len: int,
                 scale: float = 1.0) -> torch.Tensor:
    """The first ``seq_len`` cached entries of one plane of one sequence, fp32 [seq_len, Hkv, D]."""
    block_size = kv_cache.shape[2]
    blocks = block_table[:(seq_len + block_size - 1) // block_size].long()
    return kv_cache[plane, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len].float() * scale


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one sequence, as fp32 [seq_len, Hkv, D]."""
    return (gather_plane(kv_cache, 0, block_table, seq_len, k_scale),
            gather_plane(kv_cache, 1, block_table, seq_len, v_scale))


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None,
                   device: torch.device) -> torch.Tensor:
    """Bool [query_len, seq_len]: True where query i (at position seq_len-query_len+i) may attend."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of fp32 ``scores`` [..., H, Q, K]; with ``sinks`` [H], each
    head's sink logit joins every row's denominator as one more column, then is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def scheduled_sequences(meta: AttentionMetadata) -> Iterator[tuple[int, int, int, int]]:
    """(index, first query row, end query row, context length) of each sequence with
    tokens in this step."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        if starts[i + 1] > starts[i]:
            yield i, starts[i], starts[i + 1], seq_lens[i]


class ReferenceAttentionImpl(PagedAttentionImpl):
    """AttentionImpl in plain PyTorch."""

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               layer: AttentionLayerParams, out: torch.Tensor, k_scale: float,
               v_scale: float) -> None:
        group = layer.num_heads // layer.num_kv_heads
        for i, q_start, q_end, seq_len in scheduled_sequences(meta):
            query_len = q_end - q_start
            k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, k_scale, v_scale)
            k = k.repeat_interleave(group, dim=1)        # [S, H, D]
            v = v.repeat_interleave(group, dim=1)
            q = query[q_start:q_end].float()             # [Q, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
            if layer.logit_soft_cap:
                scores = layer.logit_soft_cap * torch.tanh(scores / layer.logit_soft_cap)
            mask = attention_mask(query_len, seq_len, layer.sliding_window, query.device)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = softmax_with_sinks(scores, layer.sinks)
            out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
