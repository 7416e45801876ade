"""Every quantization scheme vLLM 0.33 registers has vLLM's ideal on every profile, loadable
here or not: each quantized layer's ideal is a kernel of that scheme's family (it executes
the scheme's weight format), never the dense GEMM; where vLLM refuses the scheme, the
ideal is empty and one decision says so and what archserve does instead.

Sources (vllm 0.33.0 wheel, read, not copied): model_executor/kernels/linear/__init__.py
(_POSSIBLE_*_KERNELS and each kernel's is_supported / can_implement), fused_moe/oracle/*.py,
model_executor/layers/quantization/__init__.py (the registered methods) and each config's
get_min_capability.
"""

from __future__ import annotations

import pytest

from archserve.kernels.catalog import default_registry
from archserve.platform.profiles import PROFILE_IDS, get_profile
from archserve.quant.schemes import SCHEMES, get_scheme
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import summary_from_hf_config

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
           "torch_dtype": "bfloat16"}
DENSE_LINEAR = ("TRITON_SKINNY_GEMM", "TORCH_MATMUL")

# vLLM 0.33's registered method names (QuantizationMethods), each found in the table.
VLLM_METHODS = ("awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4",
                "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin",
                "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
                "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
                "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
                "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8")


def test_every_vllm_method_is_a_scheme():
    for method in VLLM_METHODS:
        assert get_scheme(method).in_vllm, method


def _explain(profile: str, scheme: str):
    return explain_model(get_profile(profile), summary_from_hf_config(MIXTRAL),
                         quantization=scheme, libraries="all")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_the_ideal_is_a_kernel_of_the_schemes_family(profile: str, scheme: str) -> None:
    registry = default_registry()
    found = get_scheme(scheme)
    out = _explain(profile, scheme)
    refusal = found.vllm_refusal(get_profile(profile))
    said = [d for d in out.decisions if d.reason.startswith("vLLM 0.33 refuses")]
    quantized = [r for r in out.routes if r.layer != "lm_head" and (
        (r.op == "moe" and found.moe_format is not None)
        or (r.op == "linear" and found.weight_format is not None))]
    if refusal or said:
        # Below its floor, or where none of its kernels runs (W4A8 off Hopper).
        assert len(said) == 1 and (refusal or "none of its kernels") in said[0].reason
        assert all(r.ideal is None for r in quantized)
        return
    assert not said
    for route in quantized:
        assert route.ideal is not None, (scheme, profile, route.layer, route.rejected)
        assert route.ideal not in DENSE_LINEAR, (scheme, profile, route.layer)
        formats = getattr(registry.get(route.op, route.ideal), "formats", ())
        wanted = found.moe_format if route.op == "moe" else None
        assert wanted in formats or route.op == "linear", (scheme, route.ideal)
        if route.op == "linear" and scheme != "compressed-tensors":
            assert found.weight_format in formats, (scheme, profile, route.ideal)


@pytest.mark.parametrize("profile,scheme,linear,moe", [
    ("h100", "modelopt_fp4", "MARLIN", "MARLIN_MOE"),
    ("b200", "modelopt_fp4", "FLASHINFER_CUTEDSL_NVFP4", "TRTLLM_MOE_NVFP4"),
    ("rtx5090", "modelopt_fp4", "FLASHINFER_CUTLASS_NVFP4", "FLASHINFER_CUTLASS_MOE"),
    ("b200", "modelopt", "FLASHINFER_FP8", "TRTLLM_MOE_FP8"),
    ("h100", "modelopt", "CUTLASS_FP8", "FLASHINFER_CUTLASS_MOE"),
    ("a100", "modelopt", "MARLIN", "MARLIN_MOE"),
    ("h100", "fp8_block", "FLASHINFER_DEEPGEMM_BLOCK_FP8", "TRITON_FUSED_MOE"),
    ("b200", "fp8_block", "DEEPGEMM_BLOCK_FP8", "TRTLLM_MOE_FP8"),
    ("l40s", "fp8_block", "MARLIN", "TRITON_FUSED_MOE"),
    ("h100", "gptq", "MACHETE", "MARLIN_MOE"),
    ("a100", "awq", "MARLIN", "MARLIN_MOE"),
    ("b200", "modelopt_mxfp8", "FLASHINFER_CUTEDSL_MXFP8", "TRTLLM_MOE_FP8"),
    ("a100", "modelopt_mxfp8", "MARLIN", "MARLIN_MOE"),
    ("b200", "mxfp4", "TRITON_SKINNY_GEMM", "TRTLLM_MOE_MXFP4"),   # linear stays 16-bit
    ("h100", "mxfp4", "TRITON_SKINNY_GEMM", "TRITON_MXFP4_MOE"),
    ("a100", "experts_int8", "TRITON_SKINNY_GEMM", "TRITON_FUSED_MOE"),
])
def test_vllm_033_choices(profile, scheme, linear, moe):
    routes = {r.layer: r for r in _explain(profile, scheme).routes}
    assert routes["linear (qkv, o, mlp)"].ideal == linear
    assert routes["moe experts"].ideal == moe


@pytest.mark.parametrize("profile,scheme,runs", [
    ("v100", "gptq", "TRITON_WEIGHT_ONLY"),     # vLLM: Marlin's SM75 check
    ("v100", "awq", "TRITON_WEIGHT_ONLY"),
    ("v100", "fp8", "TRITON_WEIGHT_ONLY"),      # online fp8 of the 16-bit checkpoint
    ("cpu", "gptq", "TORCH_DEQUANT"),
])
def test_where_vllm_refuses_and_archserve_degrades_one_line_says_so(profile, scheme, runs):
    out = explain_model(get_profile(profile), summary_from_hf_config(
        {k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts",)}
        | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
        quantization=scheme, dtype="float16", libraries="all")
    (line,) = [d for d in out.decisions if d.reason.startswith("vLLM 0.33 refuses")]
    assert line.reason.endswith(f"archserve degrades to {runs}"), line.reason
    linear = next(r for r in out.routes if r.layer.startswith("linear ("))
    assert (linear.backend, linear.ideal) == (runs, None)


def test_gguf_is_not_a_vllm_033_method():
    out = _explain("h100", "gguf")
    (line,) = [d for d in out.decisions if d.reason.startswith("vLLM 0.33 refuses")]
    assert "registers no gguf" in line.reason
