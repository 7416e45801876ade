"""The fused attention preamble (q/k RMSNorm, rotary, KV-cache write in one kernel)
against the unfused torch path, and the dispatch that chooses between them.

On CPU the kernel runs under Triton's interpreter in a child process (as
test_elementwise.py does); on a GPU the ``gpu``-marked tests run it at the Qwen3-0.6B and
Llama-3-8B shapes, inside a CUDA graph too.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.attention.preamble import FUSION, attention_preamble
from archserve.kernels.attention.reference import write_kv_cache as write_kv_cache_reference
from archserve.kernels.elementwise import (
    DISABLE_FUSIONS_ENV,
    forced_fused_route,
    fusion_enabled,
)
from archserve.kernels.elementwise.reference import rms_norm_reference, rotary_reference
from archserve.kernels.rules import triton_interpreted
from archserve.models.layers.rotary import RotaryEmbedding

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600
BLOCK_SIZE = 16


def preamble_case(tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype, device: str, qk_norm: bool, seed: int = 0):
    """(qkv, positions, rope, norm weights or None, empty cache, slots with one padding -1)."""
    gen = torch.Generator().manual_seed(seed * 101 + tokens * 7 + head_size)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = (torch.randn(tokens, width, generator=gen) * 2).to(device, dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen).to(device)
    rope = RotaryEmbedding(head_size, 2048, 1000000.0).to(device)
    weights = tuple((1 + 0.2 * torch.randn(head_size, generator=gen)).to(device, dtype)
                    for _ in range(2)) if qk_norm else None
    num_blocks = tokens // BLOCK_SIZE + 4
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype,
                        device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    if tokens > 1:
        slots[tokens // 2] = -1     # a padding row: nothing may be written for it
    return qkv, positions, rope, weights, cache, slots


def unfused_reference(qkv, positions, rope, weights, cache, slots, num_heads, num_kv_heads):
    """The torch path, op by op: (q [T, H D], the cache after the write)."""
    head_size = rope.head_size
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                         num_kv_heads * head_size], dim=-1)
    if weights is not None:
        q = rms_norm_reference(q.reshape(tokens, -1, head_size), weights[0], 1e-6)[0]
        k = rms_norm_reference(k.reshape(tokens, -1, head_size), weights[1], 1e-6)[0]
        q, k = q.reshape(tokens, -1), k.reshape(tokens, -1)
    q, k = rotary_reference(positions, q, k, rope.cos_cache, rope.sin_cache)
    expected_cache = cache.clone()
    write_kv_cache_reference(k.view(tokens, num_kv_heads, head_size),
                             v.reshape(tokens, num_kv_heads, head_size), expected_cache, slots)
    return q, expected_cache


def assert_rotated_match(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """As test_elementwise.assert_matches, with an absolute term of one unit in the last
    place of O(1) values: rotary mixes two normalised components, so a rounding flipped in
    the norm moves an output near zero by a fraction of that unit (seen once on an H200:
    2^-12 at a value of 0.016 in fp16, one element of 524288)."""
    from test_elementwise import assert_matches

    if expected.dtype == torch.float32:
        assert_matches(actual, expected)
        return
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * ulp, atol=ulp)


def check_fused_preamble(tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                         dtype: torch.dtype, device: str, qk_norm: bool,
                         strided_positions: bool = False) -> None:
    from test_elementwise import every_other_element

    qkv, positions, rope, weights, cache, slots = preamble_case(
        tokens, num_heads, num_kv_heads, head_size, dtype, device, qk_norm)
    expected_q, expected_cache = unfused_reference(qkv, positions, rope, weights, cache, slots,
                                                   num_heads, num_kv_heads)
    given = every_other_element(positions) if strided_positions else positions
    with forced_fused_route("triton"):
        q, k, v = attention_preamble(qkv, given, rope.cos_cache, rope.sin_cache, weights,
                                     1e-6, num_heads, num_kv_heads, cache, slots, True)
    assert k is None and v is None, "the fused path writes k and v itself"
    assert_rotated_match(q, expected_q)
    assert_rotated_match(cache, expected_cache)
    assert torch.equal(cache[1], expected_cache[1]), "v is copied, never rounded"


# ---------------------------------------------------------------- dispatch (no kernels)

def check_unfused_path(why: str, monkeypatch) -> None:
    """Each reason must leave k and v to the backend, with the unfused path's values."""
    from test_elementwise import assert_matches

    qkv, positions, rope, weights, cache, slots = preamble_case(3, 4, 2, 16, torch.float32,
                                                                "cpu", qk_norm=True)
    if why == "fp8 cache":
        cache = cache.to(torch.float8_e4m3fn)
    if why == "disabled":
        monkeypatch.setenv(DISABLE_FUSIONS_ENV, FUSION)
    route = "torch" if why == "cpu" else "triton"
    with forced_fused_route(route):
        q, k, v = attention_preamble(qkv, positions, rope.cos_cache, rope.sin_cache, weights,
                                     1e-6, 4, 2, cache, slots, why != "backend")
    expected_q, expected_k = rotary_reference(
        positions, rms_norm_reference(qkv[:, :64].reshape(3, 4, 16), weights[0], 1e-6)[0]
        .reshape(3, -1), rms_norm_reference(qkv[:, 64:96].reshape(3, 2, 16), weights[1],
                                            1e-6)[0].reshape(3, -1),
        rope.cos_cache, rope.sin_cache)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(v, qkv[:, 96:]) and v.is_contiguous()
    assert not cache.float().any(), "the unfused path leaves the write to the backend"



def test_fusion_switch(monkeypatch):
    monkeypatch.delenv(DISABLE_FUSIONS_ENV, raising=False)
    assert not fusion_enabled(FUSION, "cpu"), "CPU tensors keep the torch path"
    with forced_fused_route("triton"):
        assert fusion_enabled(FUSION, "cpu")
        monkeypatch.setenv(DISABLE_FUSIONS_ENV, f"other, {FUSION}")
        assert not fusion_enabled(FUSION, "cpu")
    with pytest.raises(ValueError, match="unknown fusion"):
        fusion_enabled("no_such_fusion", "cpu")


def test_strided_norm_weights_are_refused_by_the_fused_kernel():
    """The kernel reads the q/k norm weights with stride 1: other layouts take the unfused
    path, with the reason."""
    from archserve.kernels.attention.triton_qk_norm_rope_cache import (
        qk_norm_rope_cache_unsupported,
    )
    heads, kv_heads, head = 4, 2, 64
    qkv = torch.zeros(2, (heads + 2 * kv_heads) * head, dtype=torch.bfloat16)
    cos = torch.zeros(32, head // 2)
    cache = torch.zeros(2, 4, 16, kv_heads, head, dtype=torch.bfloat16)
    dense = torch.ones(head, dtype=torch.bfloat16)
    strided = torch.ones(2 * head, dtype=torch.bfloat16)[::2]
    assert qk_norm_rope_cache_unsupported(qkv, heads, kv_heads, head, cos, (dense, dense),
                                          cache) is None
    assert "stride" in qk_norm_rope_cache_unsupported(qkv, heads, kv_heads, head, cos,
                                                      (dense, strided), cache)


def test_attention_layer_refuses_unit_offset_qk_norms():
    # The preamble's paths all scale by the norm's weight; Gemma's (1 + w) form would be
    # silently wrong, so the layer refuses it before doing anything.
    from archserve.models.layers.attention import Attention
    from archserve.models.layers.norm import GemmaRMSNorm

    layer = Attention(4, 2, 32, 32 ** -0.5, layer_index=0)
    with pytest.raises(ValueError, match="GemmaRMSNorm"):
        layer.forward_qkv(torch.zeros(1, dtype=torch.long), torch.zeros(1, 256),
                          RotaryEmbedding(32, 8, 10000.0), GemmaRMSNorm(32), GemmaRMSNorm(32))


def test_cpu_tensors_take_the_unfused_path():
    check_unfused_path("cpu", None)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", [("hip", "gfx942", 64, "bf16")], ids=["gfx942"])
def test_kernel_compiles_for_gpu_targets(target):
    """What only a compile catches (typing, layouts, lowering), on machines without a GPU;
    ROCm because no GPU test here reaches it (the CUDA targets compile in the gpu tests)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from archserve.kernels.attention.triton_qk_norm_rope_cache import (
        _qk_norm_rope_cache_kernel,
    )

    backend, arch, warp_size, dtype = target
    act = f"*{dtype}"
    signature = {"qkv_ptr": act, "positions_ptr": "*i64", "cos_ptr": "*fp32",
                 "sin_ptr": "*fp32", "q_weight_ptr": act, "k_weight_ptr": act,
                 "q_out_ptr": act, "cache_ptr": act, "slot_mapping_ptr": "*i64",
                 **dict.fromkeys(["positions_stride", "qkv_stride", "q_out_stride",
                                  "cos_stride", "stride_cache_kv", "stride_cache_block",
                                  "stride_cache_token", "stride_cache_head"], "i32"),
                 "eps": "fp32", **dict.fromkeys(
                     ["NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "BLOCK_SIZE",
                      "Q_HEADS_BLOCK", "KV_HEADS_BLOCK", "HALF_BLOCK", "HAS_NORM", "PDL"],
                     "constexpr")}
    constexprs = {"NUM_Q_HEADS": 16, "NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "BLOCK_SIZE": 16,
                  "Q_HEADS_BLOCK": 4, "KV_HEADS_BLOCK": 8, "HALF_BLOCK": 64, "HAS_NORM": True,
                  "PDL": False}
    compiled = triton.compile(ASTSource(_qk_norm_rope_cache_kernel, signature, constexprs),
                              target=GPUTarget(backend, arch, warp_size),
                              options={"num_warps": 4})
    assert compiled.asm.get("cubin" if backend == "cuda" else "hsaco")


# ---------------------------------------------------------------- CPU: the interpreter

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("qk_norm,dtype", [
        (True, torch.float32), (True, torch.bfloat16), (True, torch.float16),
        (False, torch.bfloat16)], ids=["qwen3-fp32", "qwen3-bf16", "qwen3-fp16", "llama-bf16"])
    def test_fused_preamble_matches_unfused(qk_norm, dtype):
        check_fused_preamble(5, 4, 2, 32, dtype, "cpu", qk_norm)

    @pytest.mark.parametrize("why", ["backend", "fp8 cache", "disabled"])
    def test_unfused_path_where_the_fusion_cannot_run(why, monkeypatch):
        check_unfused_path(why, monkeypatch)

    def test_fused_preamble_odd_heads_and_head_size():
        # 3 query heads, 1 KV head, head size 80: every tile is masked.
        check_fused_preamble(2, 3, 1, 80, torch.bfloat16, "cpu", qk_norm=True)
        # 6 query heads: a full block of Q_HEADS_PER_PROGRAM and a masked one.
        check_fused_preamble(3, 6, 2, 64, torch.float32, "cpu", qk_norm=True)

    def test_fused_preamble_reads_strided_positions():
        check_fused_preamble(3, 4, 2, 32, torch.bfloat16, "cpu", True, strided_positions=True)


# ---------------------------------------------------------------- GPU, real sizes

# (heads, kv heads, head size): Qwen3-0.6B, Llama-3-8B
GPU_SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_gpu_fused_preamble_matches_unfused(model, tokens, dtype):
    for qk_norm in (True, False):
        check_fused_preamble(tokens, *GPU_SHAPES[model], dtype, "cuda", qk_norm)


@pytest.mark.gpu
def test_gpu_fused_preamble_in_a_cuda_graph(monkeypatch):
    """The automatic route takes the fusion on CUDA, and a captured graph replays it on
    new positions, inputs and slots."""
    from test_elementwise import assert_matches

    monkeypatch.delenv(DISABLE_FUSIONS_ENV, raising=False)
    assert fusion_enabled(FUSION, "cuda")
    heads, kv_heads, head_size = GPU_SHAPES["qwen3-0.6b"]
    qkv, positions, rope, weights, cache, slots = preamble_case(
        4, heads, kv_heads, head_size, torch.bfloat16, "cuda", qk_norm=True)

    def step():
        return attention_preamble(qkv, positions, rope.cos_cache, rope.sin_cache, weights,
                                  1e-6, heads, kv_heads, cache, slots, True)[0]

    step()  # eager warm-up compiles the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = step()
    cache.zero_()
    qkv.copy_(torch.randn_like(qkv))
    positions.copy_(torch.randint_like(positions, 0, 2048))
    slots.copy_(torch.tensor([3, 40, -1, 17], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    expected_q, expected_cache = unfused_reference(qkv, positions, rope, weights,
                                                   torch.zeros_like(cache), slots, heads,
                                                   kv_heads)
    assert_matches(q, expected_q)
    assert_matches(cache, expected_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_tiny_qwen3_logits_equal_with_and_without_the_fusion(dtype, tmp_path,
                                                                  monkeypatch):
    """A whole model through TRITON_ATTN, a prefill then a decode step: the fused preamble
    gives the unfused path's logits."""
    from models.helpers import tiny_hf_model

    from archserve.engine.kv_cache import model_kv_caches
    from archserve.kernels.attention.interface import AttentionMetadata
    from archserve.kernels.attention.triton_backend import TritonAttentionImpl
    from archserve.loader.loader import load_model
    from archserve.models.layers.forward_context import ForwardContext, set_forward_context

    tiny_hf_model("qwen3").save_pretrained(tmp_path)
    model, config = load_model(str(tmp_path), dtype=dtype, device="cuda")
    table = torch.arange(4, dtype=torch.int32, device="cuda")[None]  # slot == position

    def run(caches, tokens: list[int], start: int) -> torch.Tensor:
        positions = torch.arange(start, start + len(tokens), device="cuda")
        meta = AttentionMetadata.from_lengths([len(tokens)], [start + len(tokens)], table,
                                              positions.clone(), "cuda")
        with set_forward_context(ForwardContext(meta, caches, TritonAttentionImpl())):
            hidden = model(torch.tensor(tokens, device="cuda"), positions)
            return model.compute_logits(hidden[-1:])

    logits = {}
    for disabled in ("", FUSION):
        monkeypatch.setenv(DISABLE_FUSIONS_ENV, disabled)
        assert fusion_enabled(FUSION, "cuda") == (not disabled)
        caches = model_kv_caches(config, 4, BLOCK_SIZE, dtype, torch.device("cuda"))
        prefill = run(caches, [5, 17, 99, 3, 250, 41, 7], 0)
        decode = run(caches, [int(prefill[0].argmax())], 7)
        logits[disabled] = torch.cat([prefill, decode])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits[""], logits[FUSION], atol=tolerance, rtol=tolerance)
