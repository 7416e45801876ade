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
