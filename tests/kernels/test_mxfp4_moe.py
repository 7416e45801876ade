"""TRITON_FUSED_MOE on gpt-oss's experts: MXFP4 weights decoded in the kernels' registers,
expert biases and the clamped SwiGLU, against TORCH_MOE in float64 on the dequantized
weights (dequantize-then-matmul), in every layout (sorted, pair rows, CUDA-core gate/up and
down, those two decoding 32-bit words, and the tensor-core kernels through tl.dot_scaled).

On CPU the kernels run under Triton's interpreter (tests/kernels/conftest.py) at small
sizes in float32 and float16 (its bf16 tl.dot is not exact); they are compiled for SM80,
SM90, SM100 and SM120 in bf16. On a GPU the ``gpu``-marked tests run gpt-oss-20b's expert
shape in bf16 at the speed table's token counts.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from archserve.kernels.linear.quantized_weights import dequantize_mxfp4, quantize_mxfp4
from archserve.kernels.moe.expert_activation import (
    DEFAULT_ACTIVATION,
    SILU_CLAMPED,
    SWIGLU_OAI,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.routing import route
from archserve.kernels.moe.torch_moe import TorchMoEImpl
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
# gpt-oss's own (limit 7), and one these random activations reach (about a third clamped).
GPT_OSS = GatedActivation(SWIGLU_OAI, 1.702, 7.0)
CLAMPING = GatedActivation(SWIGLU_OAI, 1.5, 0.5)
# DeepSeek V4's clamped silu(gate) * up at a limit these activations reach.
V4_CLAMPING = GatedActivation(SILU_CLAMPED, limit=0.5)


def experts_case(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 mxfp4: bool, device: str = "cpu", seed: int = 0):
    """(x, logits, w13, w2, biases, dense w13, dense w2): random experts, MXFP4 as OpenAI's
    converter writes them (or 16-bit), biases of the outputs' scale."""
    gen = torch.Generator().manual_seed(seed * 7919 + tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    biases = ExpertBiases(torch.randn(experts, 2 * inter, generator=gen) * 0.3,
                          torch.randn(experts, hidden, generator=gen) * 0.3)
    if mxfp4:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        dense13, dense2 = dequantize_mxfp4(q13), dequantize_mxfp4(q2)
        w13, w2 = (dataclasses.replace(q, blocks=q.blocks.to(device), scales=q.scales.to(device))
                   for q in (q13, q2))
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
        dense13, dense2 = w13.float(), w2.float()
        w13, w2 = w13.to(device), w2.to(device)
    biases = ExpertBiases(biases.w13.to(device, dtype), biases.w2.to(device, dtype))
    return (x.to(device, dtype), logits.to(device), w13, w2, biases, dense13.to(device),
            dense2.to(device))


def reference(x, logits, dense13, dense2, top_k, activation, biases):
    """TORCH_MOE in float64 on the dequantized weights."""
    return TorchMoEImpl().forward(
        x.double(), logits, dense13.double(), dense2.double(), top_k, True,
        activation=activation,
        biases=ExpertBiases(biases.w13.double(), biases.w2.double()))


# ---------------------------------------------------------------- anywhere (no kernel)

def test_routes_of_mxfp4_experts():
    """MXFP4 experts: vLLM 0.33's choice is the ideal (native FlashInfer TRT-LLM on the
    SM100 family, OpenAI's Triton kernels on Hopper, Marlin on Ampere and on RTX Blackwell,
    where vLLM moves OpenAI's kernels last); this build's Triton kernels run them from SM80,
    and the torch loop below (dequantized)."""
    from archserve.kernels.catalog import select_moe_backend
    from archserve.kernels.specs import MoESpec
    from archserve.platform import get_profile
    spec = MoESpec(quant_scheme="mxfp4", gated_activation=SWIGLU_OAI, expert_bias=True,
                   activation="none")
    expected = {"b200": "TRTLLM_MOE_MXFP4", "h100": "TRITON_MXFP4_MOE", "a100": "MARLIN_MOE",
                "rtx5090": "MARLIN_MOE"}
    for name, ideal in expected.items():
        selection = select_moe_backend(get_profile(name), spec)
        assert (selection.ideal, selection.name) == (ideal, "TRITON_FUSED_MOE"), name
    t4 = select_moe_backend(get_profile("t4"), dataclasses.replace(spec, dtype=torch.float16))
    assert (t4.ideal, t4.name) == ("MARLIN_MOE", "TORCH_MOE")
    reasons = {r.backend: r.reason for r in t4.rejected}
    assert "SM80+" in reasons["TRITON_FUSED_MOE"]
    cpu = select_moe_backend(get_profile("cpu"), dataclasses.replace(spec, dtype=torch.float32))
    assert cpu.name == "TORCH_MOE"


def test_the_torch_loop_is_transformers_gpt_oss_experts():
    """TORCH_MOE with gpt-oss's activation and biases is transformers' GptOssExperts (the
    interleaved gate/up of its stacked weight split into gate rows and up rows)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                          swiglu_limit=CLAMPING.limit, swiglu_alpha=CLAMPING.alpha)
    theirs = GptOssExperts(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    theirs.alpha = CLAMPING.alpha
    x = torch.randn(5, 32)
    logits = torch.randn(5, 4)
    weights, ids = route(logits, 2, True)
    expected = theirs(x, ids, weights)
    gate_up = theirs.gate_up_proj.detach()           # [E, H, 2I], gate/up interleaved
    w13 = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), -1).transpose(1, 2)
    w2 = theirs.down_proj.detach().transpose(1, 2)
    bias = theirs.gate_up_proj_bias.detach()
    biases = ExpertBiases(torch.cat((bias[:, 0::2], bias[:, 1::2]), -1),
                          theirs.down_proj_bias.detach())
    got = TorchMoEImpl().forward(x, logits, w13.contiguous(), w2.contiguous(), 2, True,
                                 activation=CLAMPING, biases=biases)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_mxfp4_tiles():
    """The tuner's candidates for MXFP4 experts: both layouts, the CUDA-core gate/up and
    the slot-summing down; the pair layout's choice counts the packed bytes (a quarter of
    bf16's, plus the scales)."""
    from archserve.kernels.moe.triton_fused_moe import (
        ExpertMatrices,
        MoETile,
        candidate_tiles,
        choose_tile,
    )

    def meta(e, n, k):
        return ExpertMatrices(torch.empty(e, n, k // 2, dtype=torch.uint8, device="meta"),
                              torch.empty(e, n, k // 32, dtype=torch.uint8, device="meta"))
    w13, w2 = meta(32, 2 * 2880, 2880), meta(32, 2880, 2880)
    assert w13.shape == (32, 5760, 2880)
    assert w13.expert_bytes == 5760 * 1440 + 5760 * 90
    tiles = candidate_tiles(1, 4, w13, w2)
    assert tiles[0] == choose_tile(1, 4, w13, w2) and tiles[0].pair_rows
    assert any(t.gate_up_block_n for t in tiles) and any(t.down_block_n for t in tiles)
    assert {t.pair_rows for t in tiles} == {True, False}
    assert all(t.block_k % 32 == 0 and t.gate_up_block_k % 32 == 0
               and t.down_block_k % 32 == 0 for t in tiles)
    # The word-decoding GEMVs, each gate/up with each down, beside today's tiles; and two of
    # them near the layouts' boundary (16 tokens: 64 pairs, sorted by default).
    words = [t for t in tiles if t.mxfp4_words]
    assert len(words) == 9 and all(t.gate_up_block_n and t.down_block_n for t in words)
    sixteen = candidate_tiles(16, 4, w13, w2)
    assert not sixteen[0].pair_rows and sum(t.mxfp4_words for t in sixteen) == 2
    # Prefill batches: the sorted tiles, and the tl.dot_scaled ones (MXFP4 experts only,
    # which they run for bf16 activations only).
    large = {n: candidate_tiles(n, 4, w13, w2) for n in (256, 4096)}
    for n, cands in large.items():
        scaled = [t for t in cands if t.mxfp4_scaled_dot]
        assert len(scaled) == 3 and not any(t.pair_rows for t in cands), n
        assert scaled[0].scaled_dot_runs(w13, torch.bfloat16)
        assert not scaled[0].scaled_dot_runs(w13, torch.float16)
    dense = torch.empty(32, 5760, 2880, dtype=torch.bfloat16, device="meta")
    assert not any(t.mxfp4_scaled_dot for t in candidate_tiles(4096, 4, dense, dense[:, :2880]))
    assert not large[4096][0].scaled_dot_runs(ExpertMatrices(dense), torch.bfloat16)
    assert all(MoETile.from_key(t.key()) == t
               for t in tiles + sixteen + large[256] + large[4096])


# ---------------------------------------------------------------- compiled for real GPUs

@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", [("cuda", c, 32) for c in (80, 90, 100, 120)],
                         ids=["sm80", "sm90", "sm100", "sm120"])
def test_mxfp4_launches_compile(target):
    """bf16 activations, MXFP4 experts with biases and the clamped SwiGLU: the sorted and
    pair layouts' kernels and the CUDA-core gate/up, on every family this route serves."""
    from triton_compile import compiled_launches

    from archserve.kernels.moe.triton_fused_moe import (
        DEFAULT_TILES,
        SCALED_DOT_TILES,
        fused_moe,
        pair_tile,
    )
    x, logits, w13, w2, biases, _, _ = experts_case(4, 8, 64, 32, torch.bfloat16, True)
    routed = route(logits, 2, True)
    pair = pair_tile(8, 32, 132)
    gemv = dataclasses.replace(pair, gate_up_block_n=4, gate_up_block_k=64, down_block_n=4,
                               down_block_k=64)
    words = dataclasses.replace(gemv, mxfp4_words=True)
    kernels = []
    for tile in (DEFAULT_TILES[0][1], pair, gemv, words):
        with compiled_launches(target) as launches:
            fused_moe(x, logits, w13, w2, 2, True, tile, routed, activation=GPT_OSS,
                      biases=biases)
        kernels.append([launch.kernel for launch in launches])
        for launch in launches[:2]:
            assert launch.code() and launch.constexprs["MXFP4"]
            assert launch.constexprs["HAS_BIAS"]
        if tile.gate_up_block_n:
            assert all(launch.constexprs["WORDS"] == tile.mxfp4_words for launch in launches)
    assert kernels == [["_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"]] * 2 + [
        ["_gate_up_gemv_kernel", "_down_sum_slots_kernel"]] * 2
    # The tl.dot_scaled tiles; on Hopper the upcast weight is wgmma's register operand
    # ({A registers}, then B's shared-memory descriptor), no round trip through shared memory.
    with compiled_launches(target) as launches:
        fused_moe(x, logits, w13, w2, 2, True, SCALED_DOT_TILES[-1][1][0], routed,
                  activation=GPT_OSS, biases=biases)
    for launch in launches[:2]:
        assert launch.code() and launch.constexprs["SCALED_DOT"]
        if target[1] == 90:
            assert re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{", launch.code())
    # DeepSeek V4's clamped silu, in the tensor-core and the CUDA-core gate/up.
    for tile in (pair, gemv, words):
        with compiled_launches(target) as launches:
            fused_moe(x, logits, w13, w2, 2, True, tile, routed, activation=V4_CLAMPING)
        assert launches[0].code() and launches[0].constexprs["ACTIVATION"] == 2


# ---------------------------------------------------------------- CPU: the interpreter

F32, F16 = torch.float32, torch.float16
# tokens, experts, top_k, hidden, inter, dtype: each K of one group and of two, a decode
# and a few tokens (the interpreter runs a program at a time: sizes kept small).
CASES = [(1, 8, 2, 64, 32, F32), (5, 4, 2, 32, 64, F16)]

if INTERPRETED:
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.triton_fused_moe import MoETile, fused_moe, pair_tile

    def _tol(dtype: torch.dtype) -> float:
        return 2e-5 if dtype == torch.float32 else 6e-3

    def _word_tiles(pair: MoETile) -> list[MoETile]:
        """The word-decoding gate/up and down (MoETile.mxfp4_words) at two shapes."""
        return [dataclasses.replace(pair, gate_up_block_n=n, gate_up_block_k=k,
                                    down_block_n=dn, down_block_k=dk, mxfp4_words=True)
                for n, k, dn, dk in ((16, 32, 8, 32), (4, 64, 2, 64))]

    def test_unaligned_mxfp4_bytes_fall_back_from_words():
        """Bytes the words cannot read (a view 2 bytes in): the word tiles run the byte
        decode, and agree."""
        from archserve.kernels.moe.triton_fused_moe import ExpertMatrices
        x, logits, w13, w2, biases, d13, d2 = experts_case(2, 4, 64, 32, F32, True, seed=3)
        padded = torch.zeros(*w13.blocks.shape[:2], w13.blocks.shape[2] + 2, dtype=torch.uint8)
        padded[..., 2:] = w13.blocks
        shifted = dataclasses.replace(w13, blocks=padded[..., 2:])
        assert not ExpertMatrices.of(shifted).word_aligned()
        assert ExpertMatrices.of(w13).word_aligned()
        tile = _word_tiles(pair_tile(4, 32, 1, 32))[1]
        expected = reference(x, logits, d13, d2, 2, CLAMPING, biases)
        for w in (w13, shifted):
            got = fused_moe(x, logits, w, w2, 2, True, tile, activation=CLAMPING,
                            biases=biases)
            torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "16-bit"])
    @pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, dtype", CASES)
    def test_every_layout_matches_dequantize_then_matmul(tokens, experts, top_k, hidden, inter,
                                                          dtype, mxfp4):
        x, logits, w13, w2, biases, d13, d2 = experts_case(tokens, experts, hidden, inter,
                                                           dtype, mxfp4, seed=2)
        expected = reference(x, logits, d13, d2, top_k, CLAMPING, biases)
        pair = pair_tile(tokens * top_k, min(hidden, inter), 1, 32)
        # Sorted tiles of a K step of one group; the pair layout (K step 128: past K); its
        # CUDA-core gate/up over two K steps; the slot-summing down, with its biases; both
        # decoding 32-bit words (ignored for 16-bit experts), a K step of one group and one
        # past K (64 at K 32: its words and activations masked).
        tiles = [MoETile(16, 32, 32), pair,
                 dataclasses.replace(pair, gate_up_block_n=16, gate_up_block_k=32),
                 dataclasses.replace(pair, down_block_n=8, down_block_k=32)] + _word_tiles(pair)
        for tile in tiles:
            got = fused_moe(x, logits, w13, w2, top_k, True, tile, activation=CLAMPING,
                            biases=biases)
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got.double(), expected, atol=_tol(dtype),
                                       rtol=_tol(dtype), msg=lambda m, t=tile: f"{t}: {m}")

    def test_the_comparison_can_fail():
        """Biases, the activation's clamp and a wrong scale each move the result."""
        x, logits, w13, w2, biases, d13, d2 = experts_case(6, 8, 64, 32, F32, True, seed=4)
        tile = MoETile(16, 32, 32)
        good = fused_moe(x, logits, w13, w2, 2, True, tile, activation=CLAMPING,
                         biases=biases)
        for changed in (dict(activation=GPT_OSS, biases=biases),
                        dict(activation=CLAMPING, biases=None)):
            other = fused_moe(x, logits, w13, w2, 2, True, tile, **changed)
            assert (other - good).abs().max() > 1e-2
        scales = w13.scales.clone()
        scales[:, :, 0] += 1                  # every expert's first group doubled
        doubled = fused_moe(x, logits, dataclasses.replace(w13, scales=scales), w2, 2, True,
                            tile, activation=CLAMPING, biases=biases)
        assert (doubled - good).abs().max() > 1e-2

    @pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "16-bit"])
    def test_deepseek_v4_clamped_silu_in_every_layout(mxfp4):
        """DeepSeek V4's activation (gate and up clamped, then silu(gate) * up; no biases)
        in every layout, and the clamp moves the result."""
        x, logits, w13, w2, biases, d13, d2 = experts_case(5, 8, 64, 32, F32, mxfp4, seed=6)
        zero = ExpertBiases(torch.zeros_like(biases.w13), torch.zeros_like(biases.w2))
        expected = reference(x, logits, d13, d2, 2, V4_CLAMPING, zero)
        pair = pair_tile(10, 32, 1, 32)
        tiles = [MoETile(16, 32, 32), pair,
                 dataclasses.replace(pair, gate_up_block_n=16, gate_up_block_k=32),
                 dataclasses.replace(pair, down_block_n=8, down_block_k=32)] + _word_tiles(pair)
        for tile in tiles:
            got = fused_moe(x, logits, w13, w2, 2, True, tile, activation=V4_CLAMPING)
            torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5,
                                       msg=lambda m, t=tile: f"{t}: {m}")
        plain = fused_moe(x, logits, w13, w2, 2, True, tiles[0], activation=DEFAULT_ACTIVATION)
        assert (plain.double() - expected).abs().max() > 1e-2

    def test_scaled_dot_tiles_in_bf16():
        """The tl.dot_scaled tiles (bf16 activations: the interpreter's dot_scaled
        multiplies the decoded operands in fp32) in both layouts, a K step of one group
        and one past K; and a wrong scale moves their result."""
        x, logits, w13, w2, biases, d13, d2 = experts_case(5, 4, 64, 32, torch.bfloat16,
                                                           True, seed=2)
        expected = reference(x, logits, d13, d2, 2, CLAMPING, biases)
        scaled = dict(mxfp4_scaled_dot=True)
        tiles = [MoETile(16, 32, 32, **scaled), MoETile(16, 32, 64, **scaled),
                 dataclasses.replace(pair_tile(10, 32, 1, 32), **scaled)]
        for tile in tiles:
            got = fused_moe(x, logits, w13, w2, 2, True, tile, activation=CLAMPING,
                            biases=biases)
            torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2,
                                       msg=lambda m, t=tile: f"{t}: {m}")
        scales = w13.scales.clone()
        scales[:, :, 0] += 1
        doubled = fused_moe(x, logits, dataclasses.replace(w13, scales=scales), w2, 2, True,
                            tiles[0], activation=CLAMPING, biases=biases)
        assert (doubled.double() - expected).abs().max() > 1e-1

    def test_the_impl_runs_mxfp4_experts_on_its_default_tiles():
        x, logits, w13, w2, biases, d13, d2 = experts_case(3, 8, 64, 32, F32, True, seed=5)
        got = TritonFusedMoEImpl().forward(x, logits, w13, w2, 2, True, activation=CLAMPING,
                                           biases=biases)
        torch.testing.assert_close(got.double(), reference(x, logits, d13, d2, 2, CLAMPING,
                                                           biases), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- GPU, gpt-oss-20b's shape

# experts, top_k, hidden, inter
GPT_OSS_20B = (32, 4, 2880, 2880)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_gpu_gpt_oss_20b_experts_match_dequantize_then_matmul(tokens):
    """The speed table's token counts, bf16: the default tile and every candidate the
    tuner may time at that batch, against TORCH_MOE on the dequantized weights."""
    from archserve.kernels.moe.triton_fused_moe import candidate_tiles, fused_moe
    experts, top_k, hidden, inter = GPT_OSS_20B
    x, logits, w13, w2, biases, d13, d2 = experts_case(tokens, experts, hidden, inter,
                                                       torch.bfloat16, True, "cuda")
    expected = TorchMoEImpl().forward(
        x.float(), logits, d13, d2, top_k, True, activation=GPT_OSS,
        biases=ExpertBiases(biases.w13.float(), biases.w2.float()))
    for tile in candidate_tiles(tokens, top_k, w13, w2):
        got = fused_moe(x, logits, w13, w2, top_k, True, tile, activation=GPT_OSS,
                        biases=biases)
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2,
                                   msg=lambda m, t=tile: f"{t.key()}: {m}")
