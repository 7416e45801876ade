"""The start-up tuner of the quantized GEMMs (GPU only: it times CUDA-graph replays)."""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.linear.quantized_weights import reference_linear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuned_configs_are_installed_agree_and_are_cached(tmp_path) -> None:
    from test_dequantize_kernel import int_weight

    from archserve.kernels.linear.quantized_tuning import DEFAULT, tune_quantized
    from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear

    routine = WeightOnlyLinear()
    weights = [int_weight(4096, 4096, 4, 128, False, "cuda") for _ in range(4)]
    path = str(tmp_path / "quantized_gemms.json")
    report = tune_quantized([(routine, "TRITON_WEIGHT_ONLY", weights)], [1, 4, 64, 512],
                            torch.bfloat16, path)
    assert len(report.timings) == 4
    assert all(t.default_us > 0 for t in report.timings.values()), report.timings
    chosen = [t for t in report.timings.values() if t.chosen != DEFAULT]
    assert len(routine.configs) == len(chosen)
    for rows in (1, 4, 64, 512):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        # The chosen config may be the dequantize-then-cuBLAS path, whose bf16 weight adds
        # a rounding per product: bound the error by the output's scale, not per element.
        expected = reference_linear(x, weights[0])
        torch.testing.assert_close(routine(x, weights[0]), expected, rtol=2e-2,
                                   atol=1e-2 * float(expected.abs().max()))
    again = WeightOnlyLinear()
    cached = tune_quantized([(again, "TRITON_WEIGHT_ONLY", weights)], [1, 4, 64, 512],
                            torch.bfloat16, path)
    assert cached.from_cache and again.configs == routine.configs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
@pytest.mark.parametrize("activation", ["dynamic_token", "dynamic_group", "int8"])
def test_w8a8_decode_tuner_keeps_the_gemv_only_where_it_wins(tmp_path, activation) -> None:
    """TORCH_SCALED_MM (per-token), TRITON_BLOCK_FP8 (per-group) and TRITON_INT8: at
    decode rows the tuner times the in-kernel-quantizing GEMV against the default; what
    it installs agrees with the reference; no GEMV above W8A8_GEMV_ROWS. Prints the
    timings (the GPU log shows which won)."""
    from test_quant_gemm import (
        FP8_FLOOR,
        activations,
        assert_w8a8_close,
        fp8_weight,
        int8_weight,
    )

    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, ScaledMmFp8Linear
    from archserve.kernels.linear.int8_gemm import Int8Linear
    from archserve.kernels.linear.quantized_tuning import DEFAULT, tune_quantized
    from archserve.kernels.linear.triton_weight_only import W8A8_GEMV_ROWS

    block = activation == "dynamic_group"
    name = {"dynamic_token": "TORCH_SCALED_MM", "dynamic_group": "TRITON_BLOCK_FP8",
            "int8": "TRITON_INT8"}[activation]
    for n, k in [(4096, 4096), (28672, 4096), (4096, 14336)]:
        routine = {"dynamic_token": ScaledMmFp8Linear, "dynamic_group": BlockFp8Linear,
                   "int8": Int8Linear}[activation]()
        weights = [int8_weight(n, k, "dynamic_token", "cuda") if activation == "int8" else
                   fp8_weight(n, k, (128, 128) if block else None, activation, "cuda")
                   for _ in range(4)]
        rows = [1, 4, 16, 64]
        report = tune_quantized([(routine, name, weights)], rows, torch.bfloat16,
                                str(tmp_path / "quantized_gemms.json"))
        for key, timing in sorted(report.timings.items()):
            print(f"{key}: default {timing.default_us:.1f} us, best {timing.best_us:.1f} us, "
                  f"chosen {timing.chosen} {timing.note[:200]}")
            assert timing.default_us > 0 and timing.best_us <= timing.default_us
        tuned = [key for key in report.timings if int(key.split(":")[1].split("x")[0])
                 <= W8A8_GEMV_ROWS]
        assert len(tuned) == 3 and (activation != "dynamic_token" or len(report.timings) == 3)
        assert len(routine.configs) == sum(t.chosen != DEFAULT
                                           for t in report.timings.values())
        for r in rows:
            x = activations(r, k, torch.bfloat16, "cuda")
            assert_w8a8_close(routine(x, weights[0]), x, weights[0], floor=FP8_FLOOR)
