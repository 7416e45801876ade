"""FLEX_ATTENTION: torch's flex_attention over the whole batch packed into one sequence.

Every sequence's cached context is gathered (through its block table) into one packed K/V,
and the batch's query rows stay packed as they come. A mask_mod then allows a query to see a
key only from its own sequence, causally at the key's position (and within the sliding
window); the block mask built from it lets flex skip the tiles between different sequences.
Soft-capping is a score_mod. On CUDA flex_attention is compiled; on CPU it runs eagerly (an
unfused reference path that is fine at test sizes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from archserve.kernels.attention.interface import AttentionLayerParams, AttentionMetadata
from archserve.kernels.attention.sdpa_backend import TorchCacheWriter, dequantize, host_lengths
from archserve.kernels.specs import AttentionSpec
from archserve.platform.device import DeviceInfo


def _packed_positions(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, position within it) of every row when sequences of ``lengths`` are packed."""
    seq_ids = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device),
                                      lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(total, device=lengths.device) - starts[seq_ids]
    return seq_ids, positions


class FlexAttentionImpl(TorchCacheWriter):
    """AttentionImpl on torch.nn.attention.flex_attention."""

    def __init__(self, device: DeviceInfo | None = None, spec: AttentionSpec | None = None
                 ) -> None:
        super().__init__(device, spec)
        self._compiled: Callable | None = None

    def _flex(self, on_cuda: bool) -> Callable:
        if not on_cuda:
            return flex_attention
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=True)
        return self._compiled

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               layer: AttentionLayerParams, out: torch.Tensor, k_scale: float,
               v_scale: float) -> None:
        query_lens, seq_lens = host_lengths(meta)
        num_q, num_kv = sum(query_lens), sum(seq_lens)
        if num_q == 0:
            return
        device = query.device
        block_size = kv_cache.shape[2]
        seq_len_t = meta.seq_lens[: meta.num_seqs].long()
        query_len_t = torch.diff(meta.query_start_loc[: meta.num_seqs + 1]).long()

        kv_seq, kv_pos = _packed_positions(seq_len_t, num_kv)
        slots = (meta.block_tables[kv_seq, kv_pos // block_size].long() * block_size
                 + kv_pos % block_size)
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        k = dequantize(flat[0, slots], k_scale, query.dtype).transpose(0, 1).unsqueeze(0)
        v = dequantize(flat[1, slots], v_scale, query.dtype).transpose(0, 1).unsqueeze(0)

        q_seq, q_offset = _packed_positions(query_len_t, num_q)
        q_pos = q_offset + (seq_len_t - query_len_t)[q_seq]
        window = layer.sliding_window

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = (q_seq[q_idx] == kv_seq[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])
            if window is not None:
                allowed = allowed & (kv_pos[kv_idx] > q_pos[q_idx] - window)
            return allowed

        score_mod = None
        cap = layer.logit_soft_cap
        if cap:
            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        block_mask = create_block_mask(mask_mod, None, None, num_q, num_kv, device=device)
        q = query[:num_q].transpose(0, 1).unsqueeze(0)
        on_cuda = device.type == "cuda"
        # The compiled flex-decoding kernel (picked for short query lengths) found no valid
        # config for our dynamic packed shapes on torch 2.11 / H200 ("NoValidChoicesError");
        # the general flex kernel handles every query length, so it is always used.
        options = {"FORCE_USE_FLEX_ATTENTION": True} if on_cuda else None
        with warnings.catch_warnings():
            # Eager flex on CPU warns that it is unfused; that is the expected mode there.
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            o = self._flex(on_cuda)(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=layer.scale, enable_gqa=True, kernel_options=options)
        out[:num_q] = o[0].transpose(0, 1)
