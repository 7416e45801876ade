"""The MoE oracle's parallel inputs against vLLM 0.33's (fused_moe/oracle/fp8.py
select_fp8_moe_backend and refine_fp8_moe_block_shape; modular_kernel.py
is_supported_config's batch-invariance check). Read, not copied."""

from __future__ import annotations

import pytest

from archserve.kernels.catalog import default_registry
from archserve.kernels.moe.rules import refined_fp8_block
from archserve.kernels.registry import BackendError
from archserve.kernels.specs import MoESpec
from archserve.platform.profiles import get_profile
from archserve.routing.explain import SelectionInputs, explain_op_request

# Qwen3-30B-A3B's experts: 768 wide, hidden 2048, fp8 128x128 blocks.
QWEN3_MOE = dict(quant_scheme="fp8_block", activation="dynamic_group", intermediate_size=768,
                 hidden_size=2048)


@pytest.mark.parametrize("device,tp,ep,expected", [
    ("h100", 1, False, "TRITON_FUSED_MOE"),          # Hopper block fp8: Triton under EP = 1
    ("h100", 4, True, "FLASHINFER_CUTLASS_MOE"),     # ... FlashInfer CUTLASS under EP > 1
    ("b200", 1, False, "TRTLLM_MOE_FP8"),
    # TP 4 leaves 192 channels a rank: blocks refined to 64x64, which only Triton reads.
    ("b200", 4, False, "TRITON_FUSED_MOE"),
    ("b200", 4, True, "TRTLLM_MOE_FP8"),              # EP keeps every expert whole
])
def test_fp8_block_experts_follow_tp_and_ep(device, tp, ep, expected):
    spec = MoESpec(tensor_parallel_size=tp, expert_parallel=ep, **QWEN3_MOE)
    assert default_registry().ideal("moe", get_profile(device), spec) == expected


def test_refined_block_is_vllms_gcd_rule():
    assert refined_fp8_block(MoESpec(**QWEN3_MOE)) is None
    assert refined_fp8_block(MoESpec(tensor_parallel_size=4, **QWEN3_MOE)) == 64
    # 768 / 8 = 96: gcd(128, 96, 2048) = 32, still refinable; 768 / 16 = 48 gives 16: not.
    assert refined_fp8_block(MoESpec(tensor_parallel_size=8, **QWEN3_MOE)) == 32
    assert refined_fp8_block(MoESpec(tensor_parallel_size=16, **QWEN3_MOE)) is None


def test_batch_invariance_leaves_vllms_triton_experts_and_nothing_here():
    b200 = get_profile("b200")
    spec = MoESpec(batch_invariant=True)
    assert default_registry().ideal("moe", b200, spec) == "TRITON_FUSED_MOE"
    assert default_registry().ideal("moe", b200, MoESpec()) == "TRTLLM_MOE_BF16"
    with pytest.raises(BackendError, match="batch-invariant mode is not implemented"):
        default_registry().select("moe", b200, spec, libraries="all")


def test_explain_passes_tp_ep_and_batch_invariance_to_the_moe_oracle():
    def ideal(**inputs):
        out = explain_op_request(get_profile("h100"), "moe", quantization="fp8_block",
                                 libraries="all", inputs=SelectionInputs(**inputs))
        return out.routes[0].ideal

    assert ideal() == "TRITON_FUSED_MOE"
    assert ideal(tensor_parallel_size=2, expert_parallel=True) == "FLASHINFER_CUTLASS_MOE"
