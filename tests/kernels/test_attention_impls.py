"""TORCH_SDPA and FLEX_ATTENTION against ReferenceAttentionImpl on CPU, and every backend
(TRITON_ATTN included) at real sizes on a GPU. Triton's CPU tests are in
test_attention_triton.py (they need the interpreter in a process of their own)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    CPU_CASES,
    SINK_CASES,
    assert_matches_reference,
    make_case,
    with_empty_slots,
)

from archserve.kernels.attention.flex_backend import FlexAttentionImpl
from archserve.kernels.attention.reference import ReferenceAttentionImpl
from archserve.kernels.attention.sdpa_backend import SdpaAttentionImpl

CASE_IDS = [name for name, _ in CPU_CASES]
CASE_ARGS = [args for _, args in CPU_CASES]


@pytest.mark.parametrize("case_args", CASE_ARGS, ids=CASE_IDS)
def test_sdpa_matches_reference(case_args):
    assert_matches_reference(make_case(**case_args), SdpaAttentionImpl())


@pytest.mark.parametrize("case_args", CASE_ARGS, ids=CASE_IDS)
def test_flex_matches_reference(case_args):
    assert_matches_reference(make_case(**case_args), FlexAttentionImpl())


@pytest.mark.parametrize("case_args", [a for _, a in SINK_CASES],
                         ids=[n for n, _ in SINK_CASES])
def test_sdpa_sinks_match_reference(case_args):
    assert_matches_reference(make_case(**case_args, sinks=True), SdpaAttentionImpl())


def test_reference_sinks_are_a_softmax_column():
    """The reference's sinks as transformers' eager gpt-oss attention has them: one more
    logit per head in every row's softmax, its probability dropped (not renormalised)."""
    case = make_case([(6, 6)], num_heads=2, num_kv_heads=1, head_size=32, sinks=True, seed=4)
    out, _ = case.run(ReferenceAttentionImpl())
    q = case.query[:6].float().transpose(0, 1)                      # [H, Q, D]
    k = case.key[:6].float().transpose(0, 1)
    v = case.value[:6].float().transpose(0, 1)
    scores = q @ k.transpose(-1, -2) * case.layer.scale
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    sink = case.layer.sinks.view(2, 1, 1).expand(2, 6, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    assert probs.sum(-1).min() < 0.99           # the sinks took a share
    torch.testing.assert_close(out, (probs @ v).transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_sdpa_step_memo_follows_each_step():
    """One TORCH_SDPA instance serves every layer of every step: what it derives once a
    step (the slots to write, the rows to gather, the mask) is never a former step's."""
    impl = SdpaAttentionImpl()
    for seqs in ([(1, 37), (1, 5)], [(1, 37), (1, 5)], [(1, 70)], [(1, 9), (1, 40)]):
        assert_matches_reference(make_case(seqs, num_heads=4, num_kv_heads=2, seed=len(seqs)),
                                 impl)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_the_torch_cache_write_is_the_references(cache_dtype):
    """TORCH_SDPA's and FLEX_ATTENTION's cache write (an index_put_ on the cache by block
    and offset) leaves the cache the reference's writer does: slot -1 rows skipped, float8
    rows scaled, the other rows untouched."""
    from archserve.kernels.attention.reference import write_kv_cache
    from archserve.kernels.attention.sdpa_backend import write_kv_cache_torch, written_rows

    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 6, 2, 8, generator=gen).unbind(0)
    slots = torch.tensor([5, -1, 17, 0, -1, 31])
    start = torch.randn(2, 4, 8, 2, 8, generator=gen).to(cache_dtype)
    ours, reference = start.clone(), start.clone()
    write_kv_cache_torch(key, value, ours, written_rows(slots, 8), 0.5, 2.0)
    write_kv_cache(key, value, reference, slots, 0.5, 2.0)
    assert torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))
    assert not torch.equal(ours.view(torch.uint8), start.view(torch.uint8))


def test_sdpa_decode_skips_sequences_without_queries():
    # A sequence scheduled with no token this step must not disturb its neighbours' rows.
    case = make_case([(3, 20), (0, 9), (2, 2)], num_heads=4, num_kv_heads=2)
    assert_matches_reference(case, SdpaAttentionImpl())


def test_sdpa_attends_16_bit_in_float32_on_a_cpu_without_amx():
    """torch's CPU flash-attention kernel runs bfloat16 4-25x slower than float32 without
    AMX: there TORCH_SDPA attends in float32 and rounds the output once."""
    from torch.nn import functional as F

    from archserve.kernels.attention.sdpa_backend import attend, widened_on_cpu
    from archserve.platform.detect import device_info_for

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16)
               for shape in ((4, 6, 1, 32), (4, 2, 40, 32), (4, 2, 40, 32)))
    mask = torch.rand(4, 1, 1, 40, generator=gen) > 0.3
    mask[..., 0] = True
    out = attend(q, k, v, mask, False, 0.125, None)
    wide = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          scale=0.125, enable_gqa=True).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert widened_on_cpu(q) == (not device_info_for(q.device).features.amx)
    if widened_on_cpu(q):
        assert torch.equal(out, wide)
    else:
        torch.testing.assert_close(out, wide, atol=2e-2, rtol=2e-2)


def test_choose_num_splits_fills_idle_sms_only():
    from archserve.kernels.attention.triton_decode import choose_num_splits
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1      # 512 programs: GPU is full
    assert choose_num_splits(8, 8, 512, num_sms=132) == 8        # 64 programs: 8 splits of 64
    assert choose_num_splits(8, 8, 100, num_sms=132) == 1        # under two tiles: no split
    assert choose_num_splits(8, 8, 4096, num_sms=132) == 8       # ~4 programs per SM
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 32     # one long sequence: split hard
    assert choose_num_splits(2, 8, 4096, num_sms=0) == 1         # unknown SM count: never


def test_decode_tiles_shorten_for_short_splits():
    from archserve.kernels.attention.triton_decode import MIN_TOKENS_PER_SPLIT, decode_tiles
    assert decode_tiles(128, 8)[0] == 64                              # unsplit
    assert decode_tiles(128, 8, 4096 // 16)[0] == 64                  # long splits
    assert decode_tiles(128, 8, MIN_TOKENS_PER_SPLIT)[0] == 32          # a tile a split at most
    assert decode_tiles(256, 8)[0] == 32                              # wide heads, always


def test_prefill_autotune_drops_tiles_that_cannot_fit_shared_memory():
    import triton

    from archserve.kernels.attention.triton_prefill import (
        PREFILL_CONFIGS,
        fitting_prefill_configs,
    )
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
               for m, n, w, st in PREFILL_CONFIGS]
    h200 = 232448   # opt-in shared memory per block on SM90

    def tiles(kept):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in kept]

    # bf16, head 128: every tile fits, the measured winner (128x128, 3 stages) included.
    assert len(fitting_prefill_configs(configs, h200, 128, 2)) == len(configs)
    # fp32, head 256: only the small tiles are worth compiling.
    assert tiles(fitting_prefill_configs(configs, h200, 256, 4)) == [(64, 64, 2), (64, 32, 2),
                                                                     (32, 32, 1)]
    # Nothing fits a tiny limit: the smallest tile stays, so the tuner always has one.
    assert tiles(fitting_prefill_configs(configs, 1024, 256, 4)) == [(32, 32, 1)]


# ---------------------------------------------------------------- GPU, real sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_impls():
    from archserve.kernels.attention.triton_backend import TritonAttentionImpl
    return {"TRITON_ATTN": TritonAttentionImpl(), "TORCH_SDPA": SdpaAttentionImpl(),
            "FLEX_ATTENTION": FlexAttentionImpl()}


GPU_SHAPES = [
    # (seqs, num_heads, num_kv_heads, block_size)
    ([(1, 1000), (1, 17), (1, 300), (1, 2049)], 32, 8, 16),          # decode, GQA 4
    ([(512, 512), (100, 700), (1, 64), (257, 1300)], 32, 8, 16),     # mixed prefill/chunk
    ([(300, 300), (1, 129)], 32, 2, 32),                              # GQA 16 -> tl.dot decode
    ([(1, 4000), (1, 100)], 16, 16, 32),                              # MHA, long decode
    ([(1, 700), (300, 900), (1, 33), (64, 64)], 32, 4, 16),          # GQA 8, mixed
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", range(len(GPU_SHAPES)))
def test_gpu_backends_match_reference(backend, head_size, dtype, shape):
    # Every combination compiles (and, for Triton prefill, autotunes) afresh, so the full
    # head x dtype x shape grid is walked by our own kernels only; the torch backends get
    # a slice that exercises their own code paths.
    if backend == "TRITON_ATTN" and shape >= 2 and head_size != 128:
        pytest.skip("GQA-16, MHA and GQA-8 shapes: head 128 only")
    if backend == "TORCH_SDPA" and (head_size not in (64, 80, 128) or shape >= 2):
        pytest.skip("torch SDPA: heads 64/80/128 on the decode and mixed shapes")
    if backend == "FLEX_ATTENTION" and (head_size != 128 or dtype == torch.float32
                                        or shape >= 2):
        pytest.skip("compiled flex: head 128 in half precision on the decode and mixed shapes")
    seqs, heads, kv_heads, block_size = GPU_SHAPES[shape]
    case = make_case(seqs, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                     block_size=block_size, dtype=dtype, device="cuda", seed=shape)
    assert_matches_reference(case, _gpu_impls()[backend])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA"])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("shape", [0, 1, 4])
def test_gpu_sinks_match_reference(backend, window, shape):
    """gpt-oss's attention: sinks, head 64, bf16, with and without its 128-token window,
    on the decode (split) and mixed shapes."""
    seqs, heads, kv_heads, block_size = GPU_SHAPES[shape]
    case = make_case(seqs, num_heads=heads, num_kv_heads=kv_heads, head_size=64,
                     block_size=block_size, dtype=torch.bfloat16, device="cuda", seed=shape,
                     sliding_window=window, sinks=True)
    assert_matches_reference(case, _gpu_impls()[backend])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("features", [{}, {"sliding_window": 100, "soft_cap": 30.0}])
def test_gpu_fp8_window_softcap(backend, kv_cache_dtype, features):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    case = make_case([(1, 1500), (200, 600), (64, 64)], num_heads=32, num_kv_heads=8,
                     head_size=128, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                     device="cuda", fp8_exact_kv=False, **features)
    assert_matches_reference(case, _gpu_impls()[backend])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_gpu_split_kv_decode_matches_reference(num_splits):
    from archserve.kernels.attention.reference import ReferenceAttentionImpl
    from archserve.kernels.attention.triton_decode import decode_attention
    case = make_case([(1, 3000), (1, 5), (1, 1025)], num_heads=32, num_kv_heads=8,
                     head_size=128, dtype=torch.bfloat16, device="cuda",
                     sliding_window=700, soft_cap=20.0)
    expected, cache = case.run(ReferenceAttentionImpl())
    out = torch.empty_like(case.query)
    decode_attention(case.query, cache, case.meta.block_tables, case.meta.seq_lens,
                     case.meta.query_start_loc, out, num_seqs=3, max_seq_len=3000,
                     scale=case.layer.scale, sliding_window=700, soft_cap=20.0,
                     num_splits=num_splits)
    torch.testing.assert_close(out[:3].float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("features", [{}, {"sliding_window": 100, "soft_cap": 30.0}])
def test_gpu_flat_grid_prefill_with_empty_slots_matches_reference(features):
    """The layout of a captured mixed-step bucket (engine/mixed_graphs.py): decodes, a chunk
    over a prefix, a fresh prompt, then empty sequence slots; the autotuned bf16 kernel on
    its flat grid of query tiles, with max_query_len the bucket's token count."""
    from archserve.kernels.attention.reference import ReferenceAttentionImpl
    from archserve.kernels.attention.triton_prefill import prefill_attention
    case = make_case([(1, 1500), (300, 700), (1, 40), (77, 77)], num_heads=32, num_kv_heads=8,
                     head_size=128, dtype=torch.bfloat16, device="cuda", **features)
    expected, cache = case.run(ReferenceAttentionImpl())
    meta, tokens, empty = case.meta, case.query.shape[0], 60
    starts, seq_lens, tables = with_empty_slots(meta, empty)
    out = torch.full_like(case.query, float("nan"))
    prefill_attention(case.query, cache, tables, seq_lens, starts, out,
                      num_seqs=meta.num_seqs + empty, max_query_len=512,
                      scale=case.layer.scale, flat_grid=True,
                      sliding_window=features.get("sliding_window"),
                      soft_cap=features.get("soft_cap"))
    torch.testing.assert_close(out[:tokens].float(), expected.float(), atol=3e-2, rtol=3e-2)
