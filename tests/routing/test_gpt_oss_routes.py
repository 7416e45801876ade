"""`explain --model <gpt-oss dir> --device ...`: what runs and what would be ideal, per GPU
generation, for gpt-oss-20b's shape in OpenAI's MXFP4 form and in bf16.

vLLM 0.33 gives sinks to FlashAttention 3 on Hopper and FlashInfer's TRT-LLM kernels on
Blackwell (Triton elsewhere), and MXFP4 experts to FlashInfer TRT-LLM on the SM100 family,
OpenAI's Triton kernels on Hopper and Marlin on Ampere and RTX Blackwell: those are the
ideals (rules only here). What runs is archserve's Triton attention with sinks and its
Triton MoE with MXFP4 decoded in registers; the linear layers stay bf16, as MXFP4
checkpoints leave them.
"""

from __future__ import annotations

import os

import pytest

from archserve.platform.profiles import get_profile
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import read_model_summary

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "models")

# device -> (attention ideal, MoE ideal of MXFP4 experts)
IDEALS = {"b200": ("FLASHINFER", "TRTLLM_MOE_MXFP4"), "h100": ("FLASH_ATTN", "TRITON_MXFP4_MOE"),
          "a100": ("TRITON_ATTN", "MARLIN_MOE"), "rtx5090": ("FLASHINFER", "MARLIN_MOE")}


def _routes(model: str, device: str) -> tuple[dict, object]:
    explanation = explain_model(get_profile(device),
                                read_model_summary(os.path.join(MODELS, model)))
    return {r.layer: r for r in explanation.routes}, explanation


@pytest.mark.parametrize("device", sorted(IDEALS))
def test_mxfp4_gpt_oss_routes(device):
    routes, explanation = _routes("gpt-oss-20b", device)
    attention_ideal, moe_ideal = IDEALS[device]
    assert explanation.not_loadable is None and explanation.inputs.has_sinks
    assert (routes["attention"].backend, routes["attention"].ideal) == (
        "TRITON_ATTN", attention_ideal)
    experts = routes["moe experts"]
    assert (experts.backend, experts.ideal) == ("TRITON_FUSED_MOE", moe_ideal)
    rejected = {r.backend: r.reason for r in experts.rejected}
    if moe_ideal != "TRITON_FUSED_MOE":
        assert "not implemented in this build" in rejected[moe_ideal]
    # The dense layers are bf16 (the checkpoint quantizes the experts alone).
    assert routes["linear (qkv, o, mlp)"].backend in ("TRITON_SKINNY_GEMM", "TORCH_MATMUL")


def test_the_model_says_it_has_sinks_and_gpt_oss_experts():
    summary = read_model_summary(os.path.join(MODELS, "gpt-oss-20b"))
    assert summary.attention_facts.has_sinks and summary.sliding_window == 128
    assert (summary.num_experts, summary.experts_per_token) == (32, 4)
    assert (summary.expert_activation, summary.expert_bias) == ("swigluoai", True)
    assert summary.quantization == "mxfp4"


def test_below_sm80_the_experts_run_dequantized():
    """T4: vLLM 0.33 refuses MXFP4 below SM80 (Mxfp4Config's minimum), so there is no
    ideal; this build's Triton MoE needs SM80 too, and the torch loop runs the experts,
    dequantized at start-up; a decision says both."""
    routes, explanation = _routes("gpt-oss-20b", "t4")
    experts = routes["moe experts"]
    assert (experts.backend, experts.ideal) == ("TORCH_MOE", None)
    assert "SM80+" in {r.backend: r.reason for r in experts.rejected}["TRITON_FUSED_MOE"]
    (decision,) = [d for d in explanation.decisions if d.what == "quantization"]
    assert decision.chosen == "TORCH_MOE" and "vLLM 0.33 refuses" in decision.reason


def test_bf16_gpt_oss_experts_take_the_16_bit_route():
    routes, explanation = _routes("gpt-oss-20b-bf16", "h100")
    assert explanation.not_loadable is None
    assert routes["moe experts"].backend == "TRITON_FUSED_MOE"
