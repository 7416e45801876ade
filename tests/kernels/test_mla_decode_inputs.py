"""The MLA decode inputs kernel (absorbed query + latent write in one launch) against the
unfused steps MLAAttention takes: RMSNorm of c_kv, de-interleave, rotary, W_UK's product,
the cache write.

On CPU it runs under Triton's interpreter in a child process at small sizes (see
test_attention_triton.py for why a child) and compiles for SM90 with PDL; on a GPU the
gpu-marked tests run it at DeepSeek's sizes, through TRITON_MLA's whole decode too.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.elementwise.reference import rms_norm_reference, rotary_reference
from archserve.kernels.mla.interface import absorb_query
from archserve.kernels.rules import triton_interpreted
from archserve.models.layers.rotary import deinterleave

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 300
HAS_CUDA = torch.cuda.is_available()


def make_inputs(t, heads, nope, kv_rank, rope, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    from archserve.models.layers.rotary import RotaryEmbedding
    rotary = RotaryEmbedding(rope, 4096, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 1024,
                                                   "mscale": 0.707, "mscale_all_dim": 0.707})
    block_size, blocks = 16, 8
    kv_b = rand(heads, nope + 24, kv_rank, scale=0.1)      # [H, nope + v, L], as kv_b_proj
    slots = torch.randperm(block_size * blocks, generator=g)[:t].to(device)
    if t > 2:
        slots[1] = -1                                       # a padding row
    return dict(
        q=rand(t, heads * (nope + rope)), kv_a=rand(t, kv_rank + rope),
        positions=torch.randint(0, 4096, (t,), generator=g).to(device),
        cos_cache=rotary.cos_cache.to(device), sin_cache=rotary.sin_cache.to(device),
        kv_norm_weight=rand(kv_rank, scale=0.5) + 1, eps=1e-6, w_uk=kv_b[:, :nope],
        kv_cache=rand(1, blocks, block_size, 1, kv_rank + rope),
        slot_mapping=slots)


def reference(inputs, interleaved):
    """What MLAAttention's unfused steps compute: the absorbed query and the cache after."""
    q, kv_a, w_uk = inputs["q"], inputs["kv_a"], inputs["w_uk"]
    t = q.shape[0]
    heads, nope, kv_rank = w_uk.shape
    rope = kv_a.shape[1] - kv_rank
    q_nope, q_pe = q.view(t, heads, nope + rope).split([nope, rope], -1)
    c_kv, k_pe = kv_a.split([kv_rank, rope], -1)
    c_kv = rms_norm_reference(c_kv.contiguous(), inputs["kv_norm_weight"], inputs["eps"])[0]
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = rotary_reference(inputs["positions"], q_pe.reshape(t, -1), k_pe.contiguous(),
                                  inputs["cos_cache"], inputs["sin_cache"])
    query = absorb_query(q_nope.float(), q_pe.view(t, heads, rope).float(), w_uk.float())
    cache = inputs["kv_cache"].clone()
    latent = torch.cat((c_kv, k_pe), -1)
    slots = inputs["slot_mapping"]
    real = slots >= 0
    block_size = cache.shape[2]
    cache[0, slots[real] // block_size, slots[real] % block_size, 0] = latent[real]
    return query, cache


def check_against_reference(t, heads, nope, kv_rank, rope, dtype, device, interleaved,
                            atol):
    from archserve.kernels.mla.triton_mla_decode_inputs import (
        mla_decode_inputs,
        mla_decode_inputs_unsupported,
    )
    inputs = make_inputs(t, heads, nope, kv_rank, rope, dtype, device)
    expected_query, expected_cache = reference(inputs, interleaved)
    assert mla_decode_inputs_unsupported(inputs["q"], inputs["kv_a"], inputs["w_uk"],
                                         inputs["cos_cache"], inputs["kv_cache"]) is None
    original = inputs["kv_cache"].clone()
    query = mla_decode_inputs(**inputs, interleaved=interleaved)
    assert query.shape == (t, heads, kv_rank + rope) and query.dtype == dtype
    # The rotated q_pe goes through the unfused kernels' roundings: equal in 16 bits (in
    # fp32 the compiler may fuse a product into its sum, an ulp off). The absorbed part
    # sums 'nope' products in another order, the norm its squares: close.
    exact = dict(rtol=0, atol=0) if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(query[..., kv_rank:].float(), expected_query[..., kv_rank:],
                               **exact)
    err = (query[..., :kv_rank].float() - expected_query[..., :kv_rank]).abs().max().item()
    assert err <= atol * max(1.0, expected_query.abs().max().item()), f"max error {err:.3g}"
    # Rows at real slots hold the latent; every other row (the padding row's slot -1
    # included) is as it was.
    close = dict(rtol=1e-2, atol=1e-5) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inputs["kv_cache"], expected_cache, **close)
    slots = inputs["slot_mapping"]
    written = torch.zeros(original.shape[1] * original.shape[2], dtype=torch.bool,
                          device=original.device)
    written[slots[slots >= 0]] = True
    width = original.shape[-1]
    assert torch.equal(inputs["kv_cache"].view(-1, width)[~written],
                       original.view(-1, width)[~written])

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    # Small sizes: 3 heads, nope 16, latent 128 (two blocks of 64), rope 16; 1 row and 19
    # (two row blocks, the second partly masked, one padding slot).
    @pytest.mark.parametrize("t", [1, 19])
    @pytest.mark.parametrize("interleaved", [True, False])
    def test_kernel_matches_the_unfused_steps(t, interleaved):
        check_against_reference(t, 3, 16, 128, 16, torch.float32, "cpu", interleaved,
                                atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_compiles_for_hopper_with_pdl(monkeypatch):
    """DeepSeek's sizes in bf16 for SM90 with PDL: W_UK's tile, positions, rotary rows,
    slots and the norm weight are read before the wait; nothing is stored before it."""
    from triton_compile import compiled_launches

    from archserve.kernels.mla import triton_mla_decode_inputs as module
    monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    inputs = make_inputs(2, 16, 128, 512, 64, torch.bfloat16, "cpu")
    with compiled_launches(("cuda", 90, 32)) as launches:
        module.mla_decode_inputs(**inputs, interleaved=True)
    (launch,) = launches
    assert launch.kernel == "_mla_decode_inputs_kernel" and launch.options.get("launch_pdl")
    ptx = launch.code()
    assert "mma" in ptx
    before_wait = ptx[:ptx.index("griddepcontrol.wait")]
    assert "ld.global" in before_wait and "st.global" not in before_wait


def test_unsupported_operands_are_named():
    from archserve.kernels.mla.triton_mla_decode_inputs import mla_decode_inputs_unsupported
    inputs = make_inputs(2, 4, 16, 128, 16, torch.bfloat16, "cpu")
    args = [inputs[k] for k in ("q", "kv_a", "w_uk", "cos_cache", "kv_cache")]
    assert mla_decode_inputs_unsupported(*args) is None
    fp8_cache = inputs["kv_cache"].to(torch.float8_e4m3fn)
    assert "fp8" in mla_decode_inputs_unsupported(*args[:4], fp8_cache)
    assert "row-major" in mla_decode_inputs_unsupported(args[0][:, :-1], *args[1:])
    assert "latent 96" in mla_decode_inputs_unsupported(
        args[0], args[1][:, 32:], args[2][..., 32:], *args[3:])


# ---------------------------------------------------------------- GPU: DeepSeek's sizes

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 37])
def test_gpu_kernel_at_deepseek_sizes(dtype, t):
    check_against_reference(t, 16, 128, 512, 64, dtype, "cuda", True,
                            atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_mla_decode_from_projections_matches_its_forward(dtype):
    """TRITON_MLA's decode from the projections against its own contract's forward fed the
    unfused steps' tensors: same attention output, same cache."""
    from archserve.kernels.attention.interface import AttentionMetadata
    from archserve.kernels.mla.triton_mla import TritonMlaImpl

    t, heads, nope, kv_rank, rope = 5, 16, 128, 512, 64
    inputs = make_inputs(t, heads, nope, kv_rank, rope, dtype, "cuda")
    block_size = inputs["kv_cache"].shape[2]
    # Five sequences of 9..13 tokens whose last token is this step's, in blocks 0-7.
    seq_lens = torch.arange(9, 9 + t, dtype=torch.int32, device="cuda")
    tables = torch.randperm(8, device="cuda").to(torch.int32).repeat(t, 1)
    slots = tables[torch.arange(t), (seq_lens - 1) // block_size].long() * block_size \
        + (seq_lens - 1) % block_size
    inputs["slot_mapping"] = slots
    meta = AttentionMetadata(
        num_seqs=t, max_query_len=1, max_seq_len=int(seq_lens.max()), slot_mapping=slots,
        block_tables=tables, seq_lens=seq_lens,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device="cuda"))
    w_uv = torch.randn(heads, 24, kv_rank, device="cuda").to(dtype) * 0.1
    impl = TritonMlaImpl()
    cache = inputs["kv_cache"].clone()
    got = impl.decode_from_projections(
        inputs["q"], inputs["kv_a"], inputs["positions"], inputs["cos_cache"],
        inputs["sin_cache"], inputs["kv_norm_weight"], inputs["eps"], True, cache, meta,
        inputs["w_uk"], w_uv, 0.1)
    # The contract's forward, fed the unfused steps' tensors.
    q_nope, q_pe = inputs["q"].view(t, heads, nope + rope).split([nope, rope], -1)
    c_kv, k_pe = inputs["kv_a"].split([kv_rank, rope], -1)
    c_kv = rms_norm_reference(c_kv.contiguous(), inputs["kv_norm_weight"], inputs["eps"])[0]
    q_pe, k_pe = rotary_reference(inputs["positions"], deinterleave(q_pe).reshape(t, -1),
                                  deinterleave(k_pe).contiguous(), inputs["cos_cache"],
                                  inputs["sin_cache"])
    expected_cache = inputs["kv_cache"].clone()
    expected = impl.forward(q_nope, q_pe.view(t, heads, rope), torch.cat((c_kv, k_pe), -1),
                            expected_cache, meta, inputs["w_uk"], w_uv, 0.1)
    close = dict(rtol=1e-2, atol=1e-5) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, **close)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
