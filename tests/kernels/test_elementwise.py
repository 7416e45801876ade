"""Fused elementwise kernels (RMSNorm + residual, rotary, SiLU * mul) against their torch
references, and the dispatch that chooses between them.

The Triton kernels run on CPU through Triton's interpreter, which must be enabled before
the kernel modules are imported; so without a GPU, one test re-runs this file in a fresh
process with TRITON_INTERPRET=1 (as test_attention_triton.py does). On a GPU the
``gpu``-marked tests run the compiled kernels at real model sizes, inside a CUDA graph too.

The kernels round intermediate results exactly where the references do, so bf16 and fp16
outputs are expected to agree bit for bit except where an fp32 reduction or exp taken in
another order lands within an fp32 unit of a rounding boundary: the checks allow two units
in the last place, on at most a small fraction of the elements.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.elementwise import (
    apply_rotary,
    forced_fused_route,
    fused_kernel_route,
    rms_norm,
    silu_and_mul,
)
from archserve.kernels.elementwise.reference import (
    rms_norm_reference,
    rotary_reference,
    silu_and_mul_reference,
)
from archserve.kernels.rules import triton_interpreted
from archserve.models.layers.rotary import RotaryEmbedding

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.fixture(autouse=True)
def _deterministic_inputs():
    """Random inputs are the same on every run: a rounding flip fails a run or never does."""
    torch.manual_seed(0)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and shape; values equal but for rare differences of a unit or two in the
    last place (one flipped rounding of the normalised row, scaled by the weight)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:  # summation order and FMAs differ everywhere
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * ulp, atol=1e-6)
    # The GPU's fast rsqrt/exp and tree reductions flip a few more roundings than the
    # interpreter's numpy, which follows the reference's arithmetic more closely.
    allowed = 1e-2 if actual.is_cuda else 1e-3
    mismatched = int((actual != expected).sum())
    # A share of a small tensor can be less than one element: one flip is always "rare".
    assert mismatched <= max(1, allowed * actual.numel()), \
        f"{mismatched} of {actual.numel()} elements differ"


# ---------------------------------------------------------------- cases (any device)

def check_rms_norm(tokens: int, width: int, dtype: torch.dtype, with_residual: bool,
                   device: str, weight_dtype: torch.dtype | None = None) -> None:
    gen = torch.Generator().manual_seed(tokens * 7919 + width)
    x = (torch.randn(tokens, width, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(tokens, width, generator=gen).to(device, dtype) \
        if with_residual else None
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(device, weight_dtype or dtype)
    with forced_fused_route("triton"):
        out, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    assert_matches(out, expected)
    if with_residual:
        assert torch.equal(new_residual, expected_residual)  # one rounded add: exact
    else:
        assert new_residual is x


def check_qk_norm(tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype, device: str) -> None:
    """Per-head norm on [T, H, D] views of a fused qkv output: strided, no copy needed."""
    gen = torch.Generator().manual_seed(tokens + head_size)
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(tokens, q_width + 2 * kv_width, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(head_size, generator=gen)).to(device, dtype)
    for part in (qkv[:, :q_width], qkv[:, q_width:q_width + kv_width]):
        heads = part.view(tokens, -1, head_size)
        with forced_fused_route("triton"):
            out, _ = rms_norm(heads, weight, 1e-6)
        assert_matches(out, rms_norm_reference(heads, weight, 1e-6)[0])


def every_other_element(t: torch.Tensor) -> torch.Tensor:
    """A view of 1-D ``t``'s values with stride 2: the kernels read norm weights and
    positions where they lie, never a copy (kernels/pdl.py: they read them before PDL's
    wait, and a copy would be the kernel launched right before)."""
    return torch.stack([t, t], dim=-1)[:, 0]


def rotary_inputs(tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype, device: str, positions_dtype: torch.dtype):
    """(positions, q and k as slices of a fused qkv output, the layer's cos/sin caches)."""
    gen = torch.Generator().manual_seed(tokens * 31 + head_size)
    rope = RotaryEmbedding(head_size, 4096, 500000.0, LLAMA3_SCALING).to(device)
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(tokens, q_width + 2 * kv_width, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device, positions_dtype)
    q, k = qkv[:, :q_width], qkv[:, q_width:q_width + kv_width]
    return positions, q, k, rope.cos_cache, rope.sin_cache


def check_rotary(tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: str, inplace: bool,
                 positions_dtype: torch.dtype = torch.long) -> None:
    positions, q, k, cos, sin = rotary_inputs(tokens, num_heads, num_kv_heads, head_size,
                                              dtype, device, positions_dtype)
    expected_q, expected_k = rotary_reference(positions.long(), q, k, cos, sin)
    if inplace:
        q, k = q.contiguous(), k.contiguous()
    with forced_fused_route("triton"):
        out_q, out_k = apply_rotary(positions, q, k, cos, sin, inplace=inplace)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)


def check_silu_and_mul(tokens: int, intermediate: int, dtype: torch.dtype,
                       device: str) -> None:
    gen = torch.Generator().manual_seed(tokens * 13 + intermediate)
    x = (torch.randn(tokens, 2 * intermediate, generator=gen) * 4).to(device, dtype)
    with forced_fused_route("triton"):
        out = silu_and_mul(x)
    assert_matches(out, silu_and_mul_reference(x))


# ---------------------------------------------------------------- dispatch (no kernels)

def test_route_is_torch_on_cpu_and_when_forced():
    pytest.importorskip("triton")
    route, reason = fused_kernel_route("cpu")
    assert route == "torch" and "cpu" in reason
    assert fused_kernel_route("cuda")[0] == "triton"
    with forced_fused_route("torch"):
        assert fused_kernel_route("cuda")[0] == "torch"
    assert fused_kernel_route("cuda")[0] == "triton"


def test_route_on_a_gpu_follows_where_triton_compiles():
    """A Pascal GPU (SM61) runs the torch reference (Triton compiles for SM70+); a V100 and
    an MI300X the Triton kernels. CPU tensors stand for each profile's GPU."""
    pytest.importorskip("triton")
    from archserve.platform.emulation import compile_target
    from archserve.platform.profiles import get_profile

    routes = {}
    for profile in ("p40", "v100", "mi300x", "cpu"):
        with compile_target(get_profile(profile)):
            routes[profile] = fused_kernel_route("cpu")
    assert routes["p40"] == ("torch", "Triton compiles for SM70+ only, device is SM61")
    assert routes["v100"][0] == routes["mi300x"][0] == "triton"
    assert routes["cpu"][0] == "torch"


def test_unsupported_inputs_take_the_reference_even_when_triton_is_forced():
    # Outside the interpreter a Triton launch on CPU tensors would raise, so these
    # results can only come from the reference.
    x = torch.randn(3, 8)
    residual = torch.randn(3, 8, dtype=torch.float64)
    positions, q, k, cos, sin = rotary_inputs(3, 2, 1, 16, torch.float32, "cpu", torch.long)
    k = k.double()
    with forced_fused_route("triton"):
        out, new_residual = rms_norm(x, torch.ones(8), 1e-6, residual)
        out_q, out_k = apply_rotary(positions, q, k, cos, sin)
    expected, expected_residual = rms_norm_reference(x, torch.ones(8), 1e-6, residual)
    assert torch.equal(out, expected) and torch.equal(new_residual, expected_residual)
    expected_q, expected_k = rotary_reference(positions, q, k, cos, sin)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


def test_torch_route_rotates_in_place():
    positions, q, k, cos, sin = rotary_inputs(5, 4, 2, 16, torch.float32, "cpu", torch.long)
    q, k = q.contiguous(), k.contiguous()
    expected_q, expected_k = rotary_reference(positions, q, k, cos, sin)
    out_q, out_k = apply_rotary(positions, q, k, cos, sin, inplace=True)
    assert out_q is q and out_k is k
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


# ---------------------------------------------------------------- compiled without a GPU

def _kernel_signatures(dtype: str) -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """(kernel, signature, constexprs) for each kernel at one activation dtype."""
    from archserve.kernels.elementwise.triton_gated_act import GELU_TANH, SILU, _gated_act_kernel
    from archserve.kernels.elementwise.triton_rms_norm import _rms_norm_kernel
    from archserve.kernels.elementwise.triton_rotary import _rotary_kernel

    act = f"*{dtype}"
    rms = {"x_ptr": act, "residual_ptr": act, "weight_ptr": act, "out_ptr": act,
           "new_residual_ptr": act, **dict.fromkeys(
               ["rows_per_group", "x_group_stride", "x_row_stride", "r_group_stride",
                "r_row_stride", "weight_stride", "width"], "i32"),
           "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr",
           "UNIT_OFFSET": "constexpr", "PDL": "constexpr"}
    rotary = {"positions_ptr": "*i64", **dict.fromkeys(
                  ["q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr"], act),
              "cos_ptr": "*fp32", "sin_ptr": "*fp32", **dict.fromkeys(
                  ["positions_stride", "q_stride", "k_stride", "q_out_stride", "k_out_stride",
                   "cache_stride"], "i32"),
              **dict.fromkeys(["NUM_Q_HEADS", "NUM_K_HEADS", "HEAD_SIZE", "Q_HEADS_BLOCK",
                               "K_HEADS_BLOCK", "HALF_BLOCK"], "constexpr")}
    gated = {"x_ptr": act, "out_ptr": act, "x_stride": "i32", "width": "i32",
             "ACT": "constexpr", "BLOCK": "constexpr"}
    return [(_rms_norm_kernel, rms, {"HAS_RESIDUAL": True, "BLOCK": 4096, "UNIT_OFFSET": False,
                                     "PDL": False}),
            # Gemma's norm: (1 + weight)
            (_rms_norm_kernel, rms, {"HAS_RESIDUAL": True, "BLOCK": 1024, "UNIT_OFFSET": True,
                                     "PDL": False}),
            (_rotary_kernel, rotary, {"NUM_Q_HEADS": 32, "NUM_K_HEADS": 8, "HEAD_SIZE": 128,
                                      "Q_HEADS_BLOCK": 32, "K_HEADS_BLOCK": 8,
                                      "HALF_BLOCK": 64}),
            (_gated_act_kernel, gated, {"ACT": SILU, "BLOCK": 1024}),
            (_gated_act_kernel, gated, {"ACT": GELU_TANH, "BLOCK": 1024})]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", [("cuda", 80, 32, "bf16"), ("cuda", 90, 32, "bf16"),
                                    ("cuda", 120, 32, "bf16"), ("cuda", 70, 32, "fp16"),
                                    ("hip", "gfx942", 64, "bf16")],
                         ids=["sm80", "sm90", "sm120", "sm70-fp16", "gfx942"])
def test_kernels_compile_for_gpu_targets(target):
    """The interpreter runs Python, not Triton's compiler: this catches what only a
    compile would (typing, layouts, backend lowering) on machines without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp_size, dtype = target
    for kernel, signature, constexprs in _kernel_signatures(dtype):
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget(backend, arch, warp_size),
                                  options={"num_warps": 8})
        assert compiled.asm.get("cubin" if backend == "cuda" else "hsaco")


# ---------------------------------------------------------------- CPU: the interpreter

# Interpreted on CPU (CI time): 1 and 7 tokens cover one row and a ragged grid; the GPU
# tests below (test_gpu_kernels_match_reference) run the real model sizes and batches.
if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)


    from rounding_kernel import check_round_to_dtype

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    def test_rounding_helper_matches_torch_casts(dtype):
        """round_to_dtype is the kernels' only rounding: ties, overflow, specials."""
        check_round_to_dtype(dtype, "cpu")

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("width", [576, 4096])
    @pytest.mark.parametrize("tokens", [1, 7])
    @pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
    def test_rms_norm_matches_reference(tokens, width, dtype, with_residual):
        check_rms_norm(tokens, width, dtype, with_residual, "cpu")

    def test_rms_norm_fp32_weight_promotes_bf16_input():
        check_rms_norm(7, 576, torch.bfloat16, True, "cpu", weight_dtype=torch.float32)

    def test_rms_norm_one_dimensional_and_empty_inputs():
        x, weight = torch.randn(96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
        with forced_fused_route("triton"):
            out, _ = rms_norm(x, weight, 1e-5)
            empty, empty_residual = rms_norm(x[None][:0], weight, 1e-5, x[None][:0])
        assert_matches(out, rms_norm_reference(x, weight, 1e-5)[0])
        assert empty.shape == (0, 96) and empty_residual.shape == (0, 96)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("head_size", [64, 128])
    @pytest.mark.parametrize("tokens", [1, 7])
    def test_qk_norm_on_strided_head_views(tokens, head_size, dtype):
        check_qk_norm(tokens, 16, 8, head_size, dtype, "cpu")

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("heads", [(16, 8), (3, 1)], ids=["gqa16-8", "odd3-1"])
    @pytest.mark.parametrize("head_size", [64, 128])
    @pytest.mark.parametrize("tokens", [1, 7])
    def test_rotary_matches_reference(tokens, head_size, heads, dtype):
        check_rotary(tokens, *heads, head_size, dtype, "cpu", inplace=False)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_rotary_in_place_with_int32_positions(dtype):
        check_rotary(7, 8, 2, 128, dtype, "cpu", inplace=True, positions_dtype=torch.int32)

    def test_rotary_head_size_not_a_power_of_two():
        check_rotary(5, 4, 2, 80, torch.bfloat16, "cpu", inplace=False)

    def test_strided_norm_weight_and_positions():
        x, weight = torch.randn(3, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
        positions, q, k, cos, sin = rotary_inputs(5, 4, 2, 64, torch.bfloat16, "cpu", torch.long)
        with forced_fused_route("triton"):
            out, _ = rms_norm(x, every_other_element(weight), 1e-5)
            rotated = apply_rotary(every_other_element(positions), q, k, cos, sin)
        assert_matches(out, rms_norm_reference(x, weight, 1e-5)[0])
        for got, expected in zip(rotated, rotary_reference(positions, q, k, cos, sin),
                                 strict=True):
            assert_matches(got, expected)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("intermediate", [100, 3072])
    @pytest.mark.parametrize("tokens", [1, 7])
    def test_silu_and_mul_matches_reference(tokens, intermediate, dtype):
        check_silu_and_mul(tokens, intermediate, dtype, "cpu")

    def test_silu_and_mul_keeps_leading_dims():
        x = torch.randn(2, 3, 2 * 40, generator=torch.Generator().manual_seed(0)
                        ).to(torch.float16)
        with forced_fused_route("triton"):
            out = silu_and_mul(x)
        assert out.shape == (2, 3, 40)
        assert_matches(out, silu_and_mul_reference(x))

    @pytest.mark.parametrize("variant,dtype", [("qwen3", torch.bfloat16),
                                               ("llama", torch.float32)])
    def test_tiny_model_logits_equal_torch_path(variant, dtype, tmp_path):
        """A whole model (q/k norm, llama3 rope scaling) through the kernels vs torch ops."""
        from models.helpers import PagedSequences, tiny_hf_model

        from archserve.loader.loader import load_model

        overrides = {"llama": dict(rope_parameters={**LLAMA3_SCALING, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 16})}
        tiny_hf_model(variant, **overrides.get(variant, {})).save_pretrained(tmp_path)
        model, config = load_model(str(tmp_path), dtype=dtype, device="cpu")
        prompts = {0: [5, 17, 99, 3, 250, 41, 7], 1: [200, 1, 2]}
        logits = {}
        for route in ("torch", "triton"):
            cache = PagedSequences.for_config(config, dtype=dtype)
            with forced_fused_route(route):
                prefill = cache.run(model, prompts)
                decode = cache.run(model, {i: [int(prefill[i].argmax())] for i in prompts})
            logits[route] = torch.cat([prefill, decode])
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=tolerance,
                                   rtol=tolerance)


# ---------------------------------------------------------------- GPU, real sizes

# Qwen3-0.6B: hidden 1024, 16/8 heads of 128, intermediate 3072.
# Llama-3-8B: hidden 4096, 32/8 heads of 128, intermediate 14336.
GPU_MODELS = {"qwen3-0.6b": (1024, 16, 8, 128, 3072), "llama3-8b": (4096, 32, 8, 128, 14336)}
GPU_TOKENS = [1, 7, 256, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("model", sorted(GPU_MODELS))
def test_gpu_kernels_match_reference(model, tokens, dtype):
    hidden, heads, kv_heads, head_size, intermediate = GPU_MODELS[model]
    check_rms_norm(tokens, hidden, dtype, True, "cuda")
    check_rms_norm(tokens, hidden, dtype, False, "cuda")
    check_qk_norm(tokens, heads, kv_heads, head_size, dtype, "cuda")
    check_rotary(tokens, heads, kv_heads, head_size, dtype, "cuda", inplace=False)
    check_rotary(tokens, heads, kv_heads, head_size, dtype, "cuda", inplace=True)
    check_silu_and_mul(tokens, intermediate, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_rounding_helper_matches_torch_casts(dtype):
    from rounding_kernel import check_round_to_dtype
    check_round_to_dtype(dtype, "cuda")


@pytest.mark.gpu
def test_gpu_fp32_and_odd_sizes():
    check_rms_norm(7, 576, torch.float32, True, "cuda")
    check_rotary(7, 3, 1, 64, torch.float32, "cuda", inplace=False)
    check_silu_and_mul(7, 100, torch.float32, "cuda")
    check_rms_norm(3, 576, torch.bfloat16, True, "cuda", weight_dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_auto_route_is_triton_and_captures_in_a_cuda_graph():
    """One layer's elementwise work in a CUDA graph, replayed on new inputs."""
    assert fused_kernel_route("cuda")[0] == "triton"
    hidden, heads, kv_heads, head_size, intermediate = GPU_MODELS["qwen3-0.6b"]
    dtype, tokens = torch.bfloat16, 8
    positions, q, k, cos, sin = rotary_inputs(tokens, heads, kv_heads, head_size, dtype,
                                              "cuda", torch.long)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    gate_up = torch.randn(tokens, 2 * intermediate, device="cuda", dtype=dtype)

    def step():
        normed, new_residual = rms_norm(x, weight, 1e-6, residual)
        rotated = apply_rotary(positions, q, k, cos, sin)
        return normed, new_residual, *rotated, silu_and_mul(gate_up)

    step()  # eager warm-up compiles the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for source in (x, residual, q, k, gate_up):
        source.copy_(torch.randn_like(source))
    positions.copy_(torch.randint_like(positions, 0, 4096))
    graph.replay()
    torch.cuda.synchronize()
    expected = (*rms_norm_reference(x, weight, 1e-6, residual),
                *rotary_reference(positions, q, k, cos, sin), silu_and_mul_reference(gate_up))
    for actual, wanted in zip(outputs, expected, strict=True):
        assert_matches(actual, wanted)
