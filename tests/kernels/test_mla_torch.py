"""TORCH_REFERENCE for mla_attention: absorbed latent attention over the paged latent cache
equals the non-absorbed form (the latent expanded to per-head keys and values, then the
standard reference attention), for prefill, chunked prefill over a cached prefix and decode,
with a 16-bit and an fp8 latent cache. The oracle a Triton MLA kernel is tested against."""

from __future__ import annotations

import pytest
import torch

from archserve.engine.kv_cache import allocate_kv_caches
from archserve.kernels.attention.interface import AttentionLayerParams, AttentionMetadata
from archserve.kernels.attention.reference import ReferenceAttentionImpl, write_kv_cache
from archserve.kernels.mla.torch_mla import TorchMlaImpl

H, NOPE, ROPE, V, L = 4, 16, 8, 12, 32
BLOCK = 4


def _meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    blocks_per_seq = -(-max(seq_lens) // BLOCK)
    tables = torch.arange(len(seq_lens) * blocks_per_seq, dtype=torch.int32).view(
        len(seq_lens), blocks_per_seq).flip(1).contiguous()      # blocks out of order
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s - q, s):
            slots.append(int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
    return AttentionMetadata.from_lengths(query_lens, seq_lens, tables,
                                          torch.tensor(slots), torch.device("cpu"))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("query_lens,seq_lens", [([7, 3], [7, 3]),       # prefill
                                                 ([3, 1], [9, 6]),       # chunk over a prefix
                                                 ([1, 1, 1], [5, 12, 1])])  # decode
def test_absorbed_equals_expanded(query_lens, seq_lens, kv_dtype):
    torch.manual_seed(0)
    w_uk, w_uv = torch.randn(H, NOPE, L) * 0.2, torch.randn(H, V, L) * 0.2
    scale = (NOPE + ROPE) ** -0.5
    total = sum(seq_lens)
    latent = torch.randn(total, L + ROPE)          # every token of every sequence
    q_nope, q_pe = torch.randn(sum(query_lens), H, NOPE), torch.randn(sum(query_lens), H, ROPE)
    k_scale = 0.05 if kv_dtype != torch.float32 else 1.0
    num_blocks = len(seq_lens) * -(-max(seq_lens) // BLOCK)
    cache = allocate_kv_caches(1, num_blocks, BLOCK, 1, L + ROPE, kv_dtype,
                               torch.device("cpu"), planes=1)[0]
    mla = TorchMlaImpl()
    # Earlier steps wrote the cached prefix (this step rewrites its own tokens, the same).
    offsets = torch.tensor([0, *seq_lens]).cumsum(0).tolist()
    full = _meta(seq_lens, seq_lens)
    write_kv_cache(latent[:, None], None, cache, full.slot_mapping, k_scale)
    rows = [offsets[i] + p for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
            for p in range(s - q, s)]
    meta = _meta(query_lens, seq_lens)
    got = mla.forward(q_nope, q_pe, latent[rows], cache, meta, w_uk, w_uv, scale, k_scale)
    # Non-absorbed: expand each sequence's (cache-rounded) latent to per-head K and V.
    stored = latent if kv_dtype == torch.float32 else (latent / k_scale).to(kv_dtype).float() * k_scale
    keys = torch.cat([torch.einsum("sl,hdl->shd", stored[:, :L], w_uk),
                      stored[:, None, L:].expand(-1, H, -1)], -1)
    values = torch.einsum("sl,hvl->shv", stored[:, :L], w_uv)
    values = torch.nn.functional.pad(values, (0, NOPE + ROPE - V))
    ref_cache = allocate_kv_caches(1, num_blocks, BLOCK, H, NOPE + ROPE, torch.float32,
                                   torch.device("cpu"))[0]
    write_kv_cache(keys, values, ref_cache, full.slot_mapping)
    expected = ReferenceAttentionImpl().forward(
        torch.cat([q_nope, q_pe], -1), keys[rows], values[rows], ref_cache, meta,
        AttentionLayerParams(H, H, NOPE + ROPE, scale))[..., :V]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
