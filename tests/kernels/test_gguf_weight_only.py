"""The GGUF fixture's layers kept quantized, through TRITON_WEIGHT_ONLY as a GPU installs
it: each multiplies as the float32 dense load does, at GEMV rows, MMA rows and the
dequantize-then-GEMM rows, in both 16-bit dtypes.

The fixture (scripts/quant_fixtures/gguf_mixed.py) mixes seven block types, and fuses
shards of different types (q/k Q4_K with v Q6_K widened to 8-bit groups of 16), so every
repacking of GGUF blocks into the kernels' integer groups is multiplied here. Runs under
Triton's interpreter (tests/kernels/conftest.py); the interpreter cannot multiply bf16 in
a tl.dot, so bf16 is checked where no tl.dot does (the GEMV, and the dequantize path's torch
GEMM). On a GPU the compiled kernels are checked at every row count, and the whole model
generates in tests/quant/test_gguf_quantized.py's gpu test.
"""

from __future__ import annotations

import os

import pytest
import torch

from archserve.kernels.linear.triton_weight_only import DENSE_PREFILL_ROWS, MAX_GEMV_ROWS
from archserve.kernels.rules import triton_interpreted

INTERPRETER_TIMEOUT_S = 900
GGUF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant", "gguf-mixed",
                    "tiny-mixed.gguf")
GEMV_ROWS = [1, 3, MAX_GEMV_ROWS]
MMA_ROWS = [MAX_GEMV_ROWS + 1, 64]
# The float32 product of the dense load against a 16-bit one: the activations' and the
# outputs' rounding (bf16 keeps 8 bits) over sums of a few hundred terms.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


HAS_CUDA = torch.cuda.is_available()


def check_every_layer(device, dtype: torch.dtype, on: str, rows: list[int]) -> None:
    """Load the fixture kept quantized on ``on`` with the kernels ``device`` (a
    DeviceInfo) selects, and compare each layer's product at ``rows`` with the float32
    dense load's."""
    from archserve.engine.decode_gemms import install_quantized_kernels
    from archserve.loader.loader import load_model
    from archserve.quant.config import gguf_quant_config
    from archserve.quant.linear_state import quantized_layers
    from archserve.quant.plan import plan_quantization

    quantized, _ = load_model(GGUF, dtype=dtype, device=on, quantization=gguf_quant_config())
    plan = plan_quantization(device, gguf_quant_config(), dtype)
    assert [layer.selection.name for layer in plan.layers] == ["TRITON_WEIGHT_ONLY"]
    assert install_quantized_kernels(device, quantized, plan) == []
    dense = dict(load_model(GGUF, dtype=torch.float32)[0].named_modules())
    layers = quantized_layers(quantized)
    assert len(layers) == 8
    for name, layer in layers:
        assert layer.kernel_name == "TRITON_WEIGHT_ONLY"
        weight = dense[name].weight
        for count in rows:
            x = torch.randn(count, weight.shape[1], generator=torch.Generator().manual_seed(count))
            want = torch.nn.functional.linear(x, weight)
            got = layer(x.to(dtype).to(on), None)
            assert got.dtype == dtype
            error = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
            assert error < TOLERANCE[dtype], (name, count, error)


if triton_interpreted():   # the rest runs under Triton's interpreter

    from archserve.platform import get_profile

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_every_gguf_layer_computes_the_dense_product(dtype, monkeypatch) -> None:
        # A quantized load cannot fold the norms into its matrices; the dense one must not
        # either, to be the same matrices.
        monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
        # Interpreted kernels are slow (CI's time): each path once, at its widest rows; the
        # GPU test below takes every row count.
        rows = ([1, MAX_GEMV_ROWS] + ([MAX_GEMV_ROWS + 1, DENSE_PREFILL_ROWS]
                                      if dtype == torch.float16 else []))
        check_every_layer(get_profile("a100"), dtype, "cpu", rows)

    def test_an_engine_on_the_gpus_kernels_generates_the_cpu_routes_tokens(tmp_path,
                                                                          monkeypatch) -> None:
        """The CPU engine's model with each quantized layer's kernel swapped for a100's
        TRITON_WEIGHT_ONLY (bf16, so the GEMV: at most its rows a call) generates the
        tokens CPU_WEIGHT_ONLY does, through the prompt's step and a decode step (a further
        decode step would run the same kernels at the same row count again, at seconds a
        step interpreted)."""
        from archserve import LLM, SamplingParams
        from archserve.engine.decode_gemms import install_quantized_kernels
        from archserve.loader.loader import load_model
        from archserve.quant.config import gguf_quant_config
        from archserve.quant.linear_state import quantized_layers
        from archserve.quant.plan import plan_quantization

        monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path))
        llm = LLM(GGUF, enforce_eager=True, max_model_len=64)
        dtype = llm.llm_engine.report.dtype
        assert dtype == torch.bfloat16
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompts = ["Hello world! How are you"]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        quantized, _ = load_model(GGUF, dtype=dtype, quantization=gguf_quant_config())
        device = get_profile("a100")
        install_quantized_kernels(device, quantized,
                                  plan_quantization(device, gguf_quant_config(), dtype))
        gpu_layers = dict(quantized_layers(quantized))
        engine_layers = dict(quantized_layers(llm.llm_engine.runner.model))
        assert sorted(gpu_layers) == sorted(engine_layers)

        def in_gemv_rows(kernel):  # noqa: ANN001, ANN202
            return lambda x, w, b: torch.cat([kernel(rows, w, b)
                                              for rows in x.split(MAX_GEMV_ROWS)])

        for name, state in engine_layers.items():
            state.kernel = in_gemv_rows(gpu_layers[name].kernel)
            state.prepared = gpu_layers[name].prepared
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_compiled_gguf_layers_compute_the_dense_product(dtype, monkeypatch) -> None:
    from archserve.platform import detect

    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    check_every_layer(detect(), dtype, "cuda", GEMV_ROWS + MMA_ROWS + [DENSE_PREFILL_ROWS])
