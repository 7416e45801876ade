"""A GGUF kept quantized: the same weights as the dense load, on every block type.

The fixture (scripts/quant_fixtures/gguf_mixed.py) mixes all seven kept types, and
mixes them inside fused layers (q/k Q4_K with v Q6_K ...), so the widening of fused
shards to a common container is exercised too.
"""

from __future__ import annotations

import os

import pytest
import torch
from models.helpers import assert_greedy_outputs_track

from archserve.engine.decode_gemms import install_quantized_kernels
from archserve.loader.loader import load_model, load_model_config
from archserve.platform import get_profile
from archserve.platform.profiles import all_profiles
from archserve.quant.config import gguf_quant_config
from archserve.quant.linear_state import quantized_layers
from archserve.quant.plan import plan_quantization
from archserve.routing.dtypes import dtype_name
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import read_model_summary, summary_from_model_config

GGUF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant", "gguf-mixed",
                    "tiny-mixed.gguf")


def test_kept_quantized_weights_equal_the_dense_load(monkeypatch) -> None:
    # The dense load as loaded: a 16/32-bit load folds each norm into the matrices after it
    # (norm_folding.py), a quantized one cannot.
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    quantized, _ = load_model(GGUF, dtype=torch.float32, quantization=gguf_quant_config())
    layers = dict(quantized_layers(quantized))
    assert len(layers) == 8           # qkv, o, gate_up, down in two layers
    qkv = layers["model.layers.0.self_attn.qkv_proj"].weight
    assert (qkv.bits, qkv.group_size) == (8, 16)       # Q4_K q/k widened to fuse with Q6_K v
    # The GPU kernels step along N by one: a GGUF's [N, K] blocks must not leave the packed
    # [K / pack, N] words column-major (they read another layer's weights then).
    assert all(state.weight.qweight.is_contiguous() for state in layers.values())
    assert layers["model.layers.1.mlp.down_proj"].weight.bits == 4
    plan = plan_quantization(get_profile("cpu"), gguf_quant_config(), torch.float32)
    install_quantized_kernels(get_profile("cpu"), quantized, plan)
    dense, _ = load_model(GGUF, dtype=torch.float32)
    modules = dict(dense.named_modules())
    for name, module in quantized.named_modules():
        if name in layers:
            torch.testing.assert_close(module.weight, modules[name].weight, rtol=0, atol=0)


def test_packed_on_a_cpu_every_layer_computes_the_dense_product(tmp_path, monkeypatch) -> None:
    """CPU_WEIGHT_ONLY (a bfloat16 model on a CPU with AVX-512 BF16: int4, bf16 or fp32 per
    kind, by timing) multiplies as the float32 dense load does, within bf16's rounding."""
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path))
    quantized, _ = load_model(GGUF, dtype=torch.bfloat16, quantization=gguf_quant_config())
    plan = plan_quantization(get_profile("cpu"), gguf_quant_config(), torch.bfloat16)
    assert plan.layers[0].selection.name == "CPU_WEIGHT_ONLY"
    decisions = install_quantized_kernels(get_profile("cpu"), quantized, plan)
    assert [d.what for d in decisions] == ["CPU weight formats"]
    dense, _ = load_model(GGUF, dtype=torch.float32)
    modules = dict(dense.named_modules())
    for name, layer in quantized_layers(quantized):
        weight = modules[name].weight
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        want = torch.nn.functional.linear(x, weight)
        got = layer(x.bfloat16(), None)
        assert got.dtype == torch.bfloat16
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < 2e-2, name


@pytest.mark.parametrize("profile", [device.id for device in all_profiles()])
def test_the_engine_routes_a_gguf_as_explain_does(profile: str) -> None:
    """The engine's routes (its summary from the loaded config) are explain's for the
    file (its summary from GGUF metadata): the same scheme, so the same ideals and the same
    vLLM comparison."""
    device = get_profile(profile)
    engine = explain_model(device, summary_from_model_config(load_model_config(GGUF)[0],
                                                             is_gguf=True))
    explained = explain_model(device, read_model_summary(GGUF))
    assert [r.to_dict() for r in engine.routes] == [r.to_dict() for r in explained.routes]
    assert engine.decisions == explained.decisions


def test_a_cpu_engine_prints_explains_routes() -> None:
    from archserve import LLM

    llm = LLM(GGUF, device="cpu", enforce_eager=True, max_model_len=64)
    report = llm.llm_engine.report
    explained = explain_model(report.device, read_model_summary(GGUF),
                              dtype=dtype_name(report.dtype))
    assert [r.to_dict() for r in report.routes] == [r.to_dict() for r in explained.routes]


@pytest.mark.gpu
def test_gguf_runs_quantized_on_the_gpu() -> None:
    from archserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    prompts = ["The quick brown fox", "A paged KV cache"]
    gpu = LLM(GGUF, dtype="float16", device="cuda", max_model_len=128)
    routes = {r.layer: r.backend for r in gpu.llm_engine.report.routes}
    assert routes["linear (qkv, o, mlp)"] == "TRITON_WEIGHT_ONLY"
    got = gpu.generate(prompts, params)
    del gpu
    cpu = LLM(GGUF, dtype="float32", device="cpu", max_model_len=128)
    want = cpu.generate(prompts, params)
    assert_greedy_outputs_track(got, want)
