"""TRITON_ATTN's launches compile for real GPU targets, on CPU (tests/triton_compile.py).

The interpreter (test_attention_triton.py) checks values; the compiler refuses what the
interpreter runs: a float8 e4m3 type below SM89, SM80-only conversions on Turing/Volta, a
padded head dimension that does not lower. Each launch is the wrappers' own, so what
compiles here is what the engine launches on that GPU.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.rules import triton_interpreted

pytestmark = pytest.mark.skipif(triton_interpreted(), reason="the interpreter does not compile")

SM70, SM75, SM80, SM90, SM100, SM120 = (("cuda", c, 32) for c in (70, 75, 80, 90, 100, 120))


def _launch(target, head_size, cache_dtype, dtype=torch.float16, sinks=None, **fp8):
    """Compile the write, decode and prefill launches of one layer kind for ``target``."""
    from triton_compile import compiled_launches

    from archserve.kernels.attention.triton_cache_write import write_kv_cache
    from archserve.kernels.attention.triton_decode import decode_attention
    from archserve.kernels.attention.triton_prefill import prefill_attention

    q = torch.zeros(3, 8, head_size, dtype=dtype)
    cache = torch.zeros(2, 6, 16, 2, head_size, dtype=cache_dtype)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    seq_lens = torch.tensor([5, 20, 9], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    out = torch.empty_like(q)
    kv = torch.zeros(3, 2, head_size, dtype=dtype)
    read = {"e4m3_bits": fp8["e4m3_bits"]} if "e4m3_bits" in fp8 else {}
    with compiled_launches(target) as launches:
        write_kv_cache(kv, kv, cache, torch.arange(3), **fp8)
        decode_attention(q, cache, tables, seq_lens, starts, out, num_seqs=3, max_seq_len=20,
                         scale=0.1, sinks=sinks, **read)
        prefill_attention(q, cache, tables, seq_lens, starts, out, num_seqs=3,
                          max_query_len=2, scale=0.1, tiles=(64, 64, 4, 2), sinks=sinks,
                          **read)
    assert [c.kernel for c in launches] == ["_write_kv_kernel", "_decode_kernel",
                                            "_prefill_kernel"]
    return launches


@pytest.mark.parametrize("target", [SM80, SM90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("head_size", [40, 96, 192])
def test_odd_head_sizes_compile(target, head_size):
    """vLLM 0.33's TRITON_ATTN takes any head size >= 32 (triton_attn.py,
    TritonAttentionBackend.supports_head_size); ours pads to the next power of two."""
    launches = _launch(target, head_size, torch.bfloat16, dtype=torch.bfloat16)
    padded = 1 << (head_size - 1).bit_length()
    assert all(c.constexprs["BLOCK_D"] == padded for c in launches)
    assert all(c.constexprs["HEAD_SIZE"] == head_size for c in launches)


@pytest.mark.parametrize("target", [SM75, SM80], ids=["sm75", "sm80"])
def test_e4m3_cache_below_sm89_compiles_as_bytes(target):
    """fp8 KV below SM89 (vLLM keeps it: platforms/cuda.py, _get_backend_priorities picks
    FLASHINFER on SM8x and TRITON_ATTN on SM75 for kv_cache_dtype fp8): Triton has no e4m3
    type there, so the kernels take the cache as bytes and convert with integer operations."""
    launches = _launch(target, 72, torch.float8_e4m3fn, e4m3_bits=True)
    assert all(c.constexprs["E4M3_BITS"] for c in launches)
    assert not any("e4m3" in c.code() for c in launches)


def test_e4m3_cache_without_bytes_is_refused_below_sm89():
    """The reason for the byte path: the float8 e4m3 type does not compile for SM80."""
    with pytest.raises(Exception, match="fp8e4nv"):
        _launch(SM80, 64, torch.float8_e4m3fn, e4m3_bits=False)


@pytest.mark.parametrize("target", [SM70, SM75], ids=["sm70", "sm75"])
def test_e5m2_cache_below_sm80_compiles(target):
    """e5m2 reads widen natively everywhere; the writer encodes bytes itself below SM80,
    where Triton's fp32 -> e5m2 conversion needs SM80 instructions."""
    launches = _launch(target, 64, torch.float8_e5m2, e5m2_bits=True)
    assert launches[0].constexprs["E5M2_BITS"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_size", [40, 72, 160, 192])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("fp8_bytes", [None, True], ids=["native", "bytes"])
def test_gpu_odd_heads_and_fp8_bytes_match_reference(head_size, kv, fp8_bytes):
    """Real sizes on the GPU: odd head sizes, and the byte path an SM8x/SM7x GPU takes
    for fp8 (forced here on whatever GPU runs the test)."""
    from attention_cases import assert_matches_reference, make_case

    from archserve.kernels.attention.triton_backend import TritonAttentionImpl

    if kv == "auto" and fp8_bytes:
        pytest.skip("the byte path is for fp8 caches")
    case = make_case([(1, 700), (300, 900), (1, 33), (64, 64)], num_heads=16, num_kv_heads=4,
                     head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=kv,
                     device="cuda", seed=head_size, fp8_exact_kv=False)
    assert_matches_reference(case, TritonAttentionImpl(fp8_bytes=fp8_bytes))


@pytest.mark.parametrize("target", [SM80, SM90, SM100, SM120],
                         ids=["sm80", "sm90", "sm100", "sm120"])
def test_sinks_compile(target):
    """gpt-oss's layers (bf16, head 64, float32 sinks) on every family the Triton attention
    route serves them on."""
    sinks = torch.zeros(8, dtype=torch.float32)
    launches = _launch(target, 64, torch.bfloat16, dtype=torch.bfloat16, sinks=sinks)
    assert all(c.constexprs["SINKS"] for c in launches[1:])


@pytest.mark.parametrize("profile, tuned", [("v100", False), ("t4", False), ("a100", True),
                                            ("mi300x", True)])
def test_prefill_below_sm80_runs_the_small_tile_untuned(profile, tuned):
    """Below SM80 Triton's tl.dot runs on CUDA cores, its operands widened to fp32 in
    registers, where the autotuner's larger tiles spill (dot_has_tensor_cores): a V100's
    and a T4's 16-bit prefill is one launch of the 32x32 tile; tensor-core GPUs autotune."""
    from triton_compile import AUTOTUNED, DEFAULT, collected_launches

    from archserve.kernels.attention.triton_prefill import prefill_attention
    from archserve.platform.profiles import get_profile

    q = torch.zeros(3, 8, 128, dtype=torch.float16)
    with collected_launches(get_profile(profile)) as specs:
        prefill_attention(q, torch.zeros(2, 6, 16, 2, 128, dtype=torch.float16),
                          torch.zeros(3, 2, dtype=torch.int32),
                          torch.tensor([5, 20, 9], dtype=torch.int32),
                          torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.empty_like(q),
                          num_seqs=3, max_query_len=2, scale=0.1)
    if tuned:
        assert len(specs) > 1 and {s.kind for s in specs} == {AUTOTUNED}
    else:
        spec, = specs
        assert spec.kind == DEFAULT
        assert (dict(spec.constexprs)["BLOCK_M"], dict(spec.constexprs)["BLOCK_N"]) == (32, 32)
