"""The one-pass dequantization kernels (the weight-only prefill path) against the
reference dequantization, and the dequantize-then-GEMM routine against reference_linear.

On CPU the kernels run under Triton's interpreter in a child process (like the other
Triton test files); on a GPU the ``gpu`` test runs them at a Llama-3-8B shape.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.linear.quantized_weights import (
    ACT_NONE,
    FP8_DTYPE,
    Fp8Weight,
    IntGroupWeight,
    dequantize,
    pack_int_rows,
    reference_linear,
)
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()


def int_weight(n: int, k: int, bits: int, group: int, offsets: bool, device: str,
               act_order: bool = False) -> IntGroupWeight:
    g = torch.Generator().manual_seed(n + k + bits + group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.001
    offs = -scales * torch.randint(0, 2 ** bits, scales.shape, generator=g) if offsets else None
    perm = torch.randperm(k, generator=g) if act_order else None
    w = IntGroupWeight(pack_int_rows(q, bits), scales, offs, bits, group, k, n, perm)
    return IntGroupWeight(*(t.to(device) if isinstance(t, torch.Tensor) else t
                            for t in (w.qweight, w.scales, w.offsets, w.bits, w.group_size,
                                      w.in_features, w.out_features, w.perm)))


def fp8_weight(n: int, k: int, block: bool, device: str) -> Fp8Weight:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 3).clamp(-448, 448).to(FP8_DTYPE)
    if block:
        scale = torch.rand((n + 127) // 128, (k + 127) // 128, generator=g) + 0.01
        return Fp8Weight(w.to(device), scale.to(device), ACT_NONE, block=(128, 128))
    return Fp8Weight(w.to(device), (torch.rand(n, generator=g) + 0.01).to(device), ACT_NONE)


def check_all(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    from archserve.kernels.linear import triton_dequantize as td

    for bits, group, offsets, act_order in [(4, 32, True, False), (4, 128, False, True),
                                            (8, 64, True, False), (8, 256, False, False)]:
        w = int_weight(40, 256, bits, group, offsets, device, act_order)
        dense = td.dequantize_int_group(w, torch.float32)
        # q * s + o: a GPU build fuses it into one FMA (one rounding, not two), which near
        # an exact cancellation differs by an ulp of the terms, not of the result.
        torch.testing.assert_close(dense, dequantize(w).t(), rtol=1e-6,
                                   atol=1e-6 * float(dense.abs().max()))
        for dtype in dtypes:
            x = torch.randn(5, 256, device=device).to(dtype)
            # The dense weight is rounded to ``dtype`` before the GEMM: each product gains
            # a rounding, so the error is bounded by the output's scale, not per element.
            expected = reference_linear(x, w)
            torch.testing.assert_close(td.dequantized_linear(x, w), expected, rtol=2e-2,
                                       atol=2e-2 * float(expected.abs().max()))
    for block in (False, True):
        w = fp8_weight(136, 256, block, device)
        torch.testing.assert_close(td.dequantize_fp8(w, torch.float32), dequantize(w),
                                   rtol=1e-6, atol=0)


if INTERPRETED:   # run under Triton's interpreter on CPU (tests/kernels/conftest.py)

    def test_under_the_interpreter() -> None:
        check_all("cpu", (torch.float32,))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_compiled_on_the_gpu() -> None:
    check_all("cuda", (torch.float16, torch.bfloat16))
    from archserve.kernels.linear.triton_weight_only import DENSE_PREFILL_ROWS, WeightOnlyLinear
    w = int_weight(6144, 4096, 4, 128, False, "cuda")
    x = torch.randn(DENSE_PREFILL_ROWS * 2, 4096, device="cuda", dtype=torch.bfloat16)
    expected = reference_linear(x, w)     # bf16 dense weight: see check_all
    torch.testing.assert_close(WeightOnlyLinear()(x, w), expected, rtol=2e-2,
                               atol=2e-2 * float(expected.abs().max()))
