"""The attention preamble inside the decode kernel (fusion ``qk_norm_rope_in_decode``)
against the preamble kernel followed by the same decode kernel: the same cache rows
written and the same outputs, bit for bit (both round q and k the same way, and the decode
kernel then reads the same cache).

On CPU the kernels run under Triton's interpreter in a child process; the ``gpu``-marked
test runs them at Qwen3's shapes.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.attention.interface import DecodePreamble
from archserve.kernels.rules import triton_interpreted
from archserve.models.layers.rotary import RotaryEmbedding

INTERPRETED = triton_interpreted()
BLOCK_SIZE = 16


def decode_case(context_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
                dtype: torch.dtype, device: str, qk_norm: bool, seed: int = 0):
    """A decode step of sequences with ``context_lens`` tokens (the last one new, the
    others cached with random rows), plus one padding sequence with no query and a padding
    row (slot -1): (qkv, metadata dict, preamble, cache)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    blocks_per_seq = max(context_lens) // BLOCK_SIZE + 1
    num_blocks = (num_seqs + 1) * blocks_per_seq
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size,
                        generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:(num_seqs + 1) * blocks_per_seq]
    tables = tables.view(num_seqs + 1, blocks_per_seq).to(torch.int32)
    lens = torch.tensor(context_lens + [0], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in context_lens] + [0])
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for i, n in enumerate(context_lens)] + [-1])
    query_start_loc = torch.tensor(list(range(num_seqs + 1)) + [num_seqs], dtype=torch.int32)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = (torch.randn(num_seqs + 1, width, generator=gen) * 2).to(device, dtype)
    rope = RotaryEmbedding(head_size, 4096, 1000000.0).to(device)
    weights = tuple((1 + 0.2 * torch.randn(head_size, generator=gen)).to(device, dtype)
                    for _ in range(2)) if qk_norm else None
    meta = dict(block_tables=tables.to(device), seq_lens=lens.to(device),
                query_start_loc=query_start_loc.to(device), num_seqs=num_seqs + 1,
                max_seq_len=max(context_lens))
    preamble = DecodePreamble(positions.to(device), rope.cos_cache, rope.sin_cache, weights,
                              1e-6, slots.to(device))
    return qkv, meta, preamble, cache


def check_preamble_in_decode(context_lens, num_heads, num_kv_heads, head_size, dtype, device,
                             qk_norm, num_splits=None, num_sms=0) -> None:
    from archserve.kernels.attention.triton_decode import decode_attention
    from archserve.kernels.attention.triton_qk_norm_rope_cache import qk_norm_rope_cache

    qkv, meta, p, cache = decode_case(context_lens, num_heads, num_kv_heads, head_size, dtype,
                                      device, qk_norm)
    tokens = qkv.shape[0]
    common = dict(scale=head_size ** -0.5, num_splits=num_splits, num_sms=num_sms, **meta)
    expected_cache = cache.clone()
    q = qk_norm_rope_cache(qkv, p.positions, p.cos_cache, p.sin_cache, p.norm_weights, p.eps,
                           expected_cache, p.slot_mapping, num_heads, num_kv_heads)
    expected = torch.zeros(tokens, num_heads, head_size, dtype=dtype, device=device)
    decode_attention(q.view(tokens, num_heads, head_size), expected_cache, out=expected,
                     **common)
    out = torch.zeros_like(expected)
    decode_attention(qkv.view(tokens, num_heads + 2 * num_kv_heads, head_size), cache,
                     out=out, preamble=p, **common)
    assert torch.equal(cache, expected_cache), "the same k and v rows written, nothing else"
    live = len(context_lens)
    assert torch.equal(out[:live], expected[:live])
    assert not out[live:].any(), "the padding row is left alone"


if not INTERPRETED:

    @pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked tests run")
    def test_decode_preamble_under_interpreter():
        from triton_interpreter import assert_passes_under_interpreter
        assert_passes_under_interpreter(__file__, timeout=300)

else:
    @pytest.mark.parametrize("num_splits", [1, 4])
    @pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_decode_kernel_does_the_preamble(dtype, qk_norm, num_splits):
        # Groups of 4 heads; contexts from one token (the new one alone) to four tiles,
        # split 4 ways: the new row's split writes it, the others read older rows only.
        check_preamble_in_decode([1, 37, 130], 8, 2, 32, dtype, "cpu", qk_norm, num_splits)


def test_decode_preamble_declines_what_the_kernel_cannot_do():
    from archserve.kernels.attention.triton_decode import decode_preamble_unsupported

    cos = torch.zeros(8, 48)
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 96)
    qkv = torch.zeros(3, 12 * 96)
    assert "power of two" in decode_preamble_unsupported(qkv, 8, 2, 96, cos, None, cache)
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 64, dtype=torch.float8_e4m3fn)
    assert "fp8" in decode_preamble_unsupported(torch.zeros(3, 12 * 64), 8, 2, 64,
                                                torch.zeros(8, 32), None, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)], ids=["qwen3-0.6b", "qwen3-30b-a3b"])
def test_gpu_decode_kernel_does_the_preamble(heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    contexts = [1, 63, 64, 65, 300, 2049]
    for splits, num_sms in ((1, 0), (None, sms)):
        check_preamble_in_decode(contexts, *heads, 128, torch.bfloat16, "cuda", True, splits,
                                 num_sms)
