"""What Gemma 3 adds to the kernels: GELU(tanh) * up, the unit-offset RMSNorm (scale by
1 + weight in fp32), and attention with head size 256 under a sliding window.

Triton runs on CPU through its interpreter in a child process (as in test_elementwise.py);
the torch attention backends run here directly; ``gpu`` tests run the compiled kernels.

torch computes gelu_tanh as 0.5 g (1 + tanh(..)): for g below about -3, 1 + tanh cancels
to a few fp32 units, so there the kernel (whose tanh is built from exp) and torch each
round their own noise; those elements may differ by more than a unit in the last place
of bf16/fp16, but by no more than that noise (a few 2**-24 of |gate * up|). Elsewhere results agree bit for bit but for
rare flips, as for SiLU.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import assert_matches_reference, make_case

from archserve.kernels.elementwise import forced_fused_route, gelu_tanh_and_mul, rms_norm
from archserve.kernels.elementwise.reference import (
    gelu_tanh_and_mul_reference,
    rms_norm_reference,
)
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# Gemma-3-270M's attention shape (4 query heads on 1 KV head of 256) with a small window.
GEMMA_ATTENTION_CASES = [
    ("prefill-window", dict(seqs=[(40, 40), (5, 5)], sliding_window=9)),
    ("chunked-window", dict(seqs=[(12, 50), (1, 33)], sliding_window=9)),
    ("decode-window-bf16", dict(seqs=[(1, 50), (1, 7)], sliding_window=9,
                                dtype=torch.bfloat16)),
    ("chunked-full-bf16", dict(seqs=[(20, 45)], dtype=torch.bfloat16)),
]


def gemma_case(**kwargs):
    return make_case(num_heads=4, num_kv_heads=1, head_size=256, **kwargs)


def check_gelu_tanh_and_mul(tokens: int, intermediate: int, dtype: torch.dtype,
                            device: str) -> None:
    gen = torch.Generator().manual_seed(tokens * 13 + intermediate)
    x = (torch.randn(tokens, 2 * intermediate, generator=gen) * 3).to(device, dtype)
    with forced_fused_route("triton"):
        out = gelu_tanh_and_mul(x)
    expected = gelu_tanh_and_mul_reference(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    gate, up = x[..., :intermediate].float(), x[..., intermediate:].float()
    outside_tail = gate > -3
    torch.testing.assert_close(out[outside_tail].float(), expected[outside_tail].float(),
                               rtol=2 * ULP[dtype], atol=1e-6)
    mismatched = int((out != expected)[outside_tail].sum())
    allowed = 1e-2 if out.is_cuda else 1e-3
    assert mismatched <= max(1, allowed * int(outside_tail.sum())), mismatched
    # In the tail each side carries a few fp32 units (2**-24) of noise in 1 + tanh.
    tail = ~outside_tail
    error = (out.float() - expected.float()).abs()[tail]
    bound = 2.0 ** -20 * (gate * up).abs()[tail] + 2 * ULP[dtype] * expected.float().abs()[tail]
    assert bool((error <= bound).all()), float((error - bound).max())


def check_unit_offset_rms_norm(tokens: int, width: int, dtype: torch.dtype,
                               with_residual: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(tokens * 7919 + width)
    x = (torch.randn(tokens, width, generator=gen) * 3).to(device, dtype)
    residual = (torch.randn(tokens, width, generator=gen).to(device, dtype)
                if with_residual else None)
    weight = (0.3 * torch.randn(width, generator=gen)).to(device, dtype)
    with forced_fused_route("triton"):
        out, new_residual = rms_norm(x, weight, 1e-6, residual, unit_offset=True)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual,
                                                     unit_offset=True)
    assert out.dtype == dtype and torch.equal(new_residual, expected_residual)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * ULP[dtype], atol=1e-6)
    allowed = 1e-2 if out.is_cuda else 1e-3
    assert int((out != expected).sum()) <= max(1, allowed * out.numel())


# ---------------------------------------------------------------- references and torch

def test_unit_offset_reference_is_gemmas_norm():
    """(1 + w) in fp32, rounded once: unlike the Llama form, which rounds the normalised
    row before a multiply in the activations' dtype."""
    x = torch.randn(5, 64).to(torch.bfloat16)
    weight = (0.3 * torch.randn(64)).to(torch.bfloat16)
    out, _ = rms_norm_reference(x, weight, 1e-6, unit_offset=True)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
                * (1 + weight.float())).to(torch.bfloat16)
    assert torch.equal(out, expected)
    llama_form = rms_norm_reference(x, 1 + weight, 1e-6)[0]
    assert not torch.equal(out, llama_form)


def test_gelu_tanh_reference_is_the_tanh_approximation():
    x = torch.randn(3, 2 * 50, dtype=torch.float64)
    gate, up = x[:, :50], x[:, 50:]
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(inner))
    torch.testing.assert_close(gelu_tanh_and_mul(x), tanh_gelu * up)
    assert not torch.allclose(gelu_tanh_and_mul(x), torch.nn.functional.gelu(gate) * up)


@pytest.mark.parametrize("name,case_args", GEMMA_ATTENTION_CASES,
                         ids=[n for n, _ in GEMMA_ATTENTION_CASES])
def test_torch_attention_head256_window(name, case_args):
    from archserve.kernels.attention.flex_backend import FlexAttentionImpl
    from archserve.kernels.attention.sdpa_backend import SdpaAttentionImpl
    assert_matches_reference(gemma_case(**case_args), SdpaAttentionImpl())
    assert_matches_reference(gemma_case(**case_args), FlexAttentionImpl())


# ---------------------------------------------------------------- CPU: the interpreter

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("intermediate", [100, 2048])
    @pytest.mark.parametrize("tokens", [1, 7])
    def test_gelu_tanh_and_mul_matches_reference(tokens, intermediate, dtype):
        check_gelu_tanh_and_mul(tokens, intermediate, dtype, "cpu")

    def test_gelu_tanh_and_mul_strided_rows_and_leading_dims():
        x = torch.randn(2, 3, 2 * 40, generator=torch.Generator().manual_seed(0))
        with forced_fused_route("triton"):
            out = gelu_tanh_and_mul(x.to(torch.bfloat16))
            strided = gelu_tanh_and_mul(x.view(6, 80)[::2])
        assert out.shape == (2, 3, 40)
        torch.testing.assert_close(strided, gelu_tanh_and_mul_reference(x.view(6, 80)[::2]),
                                   rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("width", [256, 640])
    @pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
    def test_unit_offset_rms_norm_matches_reference(width, dtype, with_residual):
        check_unit_offset_rms_norm(7, width, dtype, with_residual, "cpu")

    def test_unit_offset_rms_norm_on_head_views():
        """Gemma's q/k norm: per head of 256 on strided views of the fused qkv output."""
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(5, (4 + 1 + 1) * 256, generator=gen).to(torch.bfloat16)
        weight = (0.3 * torch.randn(256, generator=gen)).to(torch.bfloat16)
        heads = qkv[:, :4 * 256].view(5, 4, 256)
        with forced_fused_route("triton"):
            out, _ = rms_norm(heads, weight, 1e-6, unit_offset=True)
        # Within one bf16 unit in the last place: the kernel and the reference add the
        # squares in different orders, and an fp32 sum a hair apart can round to the
        # neighbouring bf16 (an unseeded input hit that tie once in CI).
        torch.testing.assert_close(out, rms_norm_reference(heads, weight, 1e-6,
                                                           unit_offset=True)[0],
                                   rtol=2.0 ** -7, atol=0)

    @pytest.mark.parametrize("name,case_args", GEMMA_ATTENTION_CASES,
                             ids=[n for n, _ in GEMMA_ATTENTION_CASES])
    def test_triton_attention_head256_window(name, case_args):
        from archserve.kernels.attention.triton_backend import TritonAttentionImpl
        assert_matches_reference(gemma_case(**case_args), TritonAttentionImpl())


# ---------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_gpu_gemma_elementwise_kernels(tokens, dtype):
    # Gemma-3-270M: hidden 640, intermediate 2048; Gemma-3-27B: 5376, 21504.
    for hidden, intermediate in ((640, 2048), (5376, 21504)):
        check_gelu_tanh_and_mul(tokens, intermediate, dtype, "cuda")
        check_unit_offset_rms_norm(tokens, hidden, dtype, True, "cuda")
        check_unit_offset_rms_norm(tokens, 256, dtype, False, "cuda")
