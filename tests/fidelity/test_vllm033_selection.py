"""`explain`'s ideal route against vLLM 0.33.0's own selection, case by case.

Each case states the backend vLLM 0.33.0 picks and where that comes from (file and function
in the vllm 0.33.0 wheel; read, not copied). The ideal is asked with every library assumed
present, as vLLM's choice assumes its own build.
"""

from __future__ import annotations

import pytest

from archserve.kernels.registry import BackendError
from archserve.platform.profiles import get_profile
from archserve.routing.explain import SelectionInputs, explain_op_request

CUDA_PRIORITY = "platforms/cuda.py, _get_backend_priorities"
FA_VERSION = "v1/attention/backends/fa_utils.py, get_flash_attn_version"
FA_KV = "v1/attention/backends/fa_utils.py, flash_attn_supports_kv_cache_dtype"
FA_COMBO = "v1/attention/backends/flash_attn.py, FlashAttentionBackend.supports_combination"
FA_HEAD = "v1/attention/backends/flash_attn.py, FlashAttentionBackend.supports_head_size"
FI_HEAD = "v1/attention/backends/flashinfer.py, FlashInferBackend.get_supported_head_sizes"
FI_SINK = "v1/attention/backends/flashinfer.py, FlashInferBackend.supports_sink"
TRITON = "v1/attention/backends/triton_attn.py, TritonAttentionBackend"
BLOCK = "v1/attention/backend.py, AttentionBackend.supports_block_size"
BASE = "v1/attention/backend.py, AttentionBackend.validate_configuration"
VIT = "platforms/cuda.py, get_supported_vit_attn_backends / get_vit_attn_backend"
MLA_PREFILL = "platforms/interface.py, get_mla_prefill_backend_cls"
FLASHMLA = "v1/attention/ops/flashmla.py, is_flashmla_dense_supported"

# (id, device, op, head, kwargs, vLLM's backend, FA version or None, source)
CASES = [
    ("fi-head-512-b200", "b200", "attention", 512, {}, "FLASHINFER", None, FI_HEAD),
    ("fi-head-96-b200", "b200", "attention", 96, {}, "FLASH_ATTN", "FA4", FI_HEAD),
    ("fi-head-160-b200", "b200", "attention", 160, {}, "FLASH_ATTN", "FA2", FA_VERSION),
    ("fa4-head-512-h100", "h100", "attention", 512, {}, "FLASH_ATTN", "FA4", FA_VERSION),
    ("fa4-head-320-h200", "h200", "attention", 320, {}, "FLASH_ATTN", "FA4", FA_VERSION),
    ("fa-head-512-a100-flashinfer", "a100", "attention", 512, {}, "FLASHINFER", None, FA_HEAD),
    ("fa-head-320-a100-triton", "a100", "attention", 320, {}, "TRITON_ATTN", None, FA_HEAD),
    ("fa-head-320-thor", "thor", "attention", 320, {}, "FLASH_ATTN", "FA2", FA_HEAD),
    ("fa-e5m2-h100", "h100", "attention", 128, {"kv_cache_dtype": "fp8_e5m2"},
     "FLASHINFER", None, FA_KV),
    ("fa-e4m3-h100", "h100", "attention", 128, {"kv_cache_dtype": "fp8"},
     "FLASH_ATTN", "FA3", FA_KV),
    ("fa4-fp8-head-512-h100", "h100", "attention", 512, {"kv_cache_dtype": "fp8"},
     "FLASH_ATTN", "FA4", FA_KV),
    ("fp8-a100-flashinfer", "a100", "attention", 128, {"kv_cache_dtype": "fp8"},
     "FLASHINFER", None, FA_KV),
    ("fp8-t4-triton", "t4", "attention", 128, {"kv_cache_dtype": "fp8"},
     "TRITON_ATTN", None, TRITON),
    ("fp8-v100-triton", "v100", "attention", 128, {"kv_cache_dtype": "fp8_e5m2"},
     "TRITON_ATTN", None, TRITON),
    ("fp8-rtx5090-flashinfer", "rtx5090", "attention", 128, {"kv_cache_dtype": "fp8"},
     "FLASHINFER", None, FA_KV),
    ("fa4-fp8-b200-non-causal", "b200", "attention", 128,
     {"kv_cache_dtype": "fp8", "inputs": SelectionInputs(non_causal=True)},
     "FLASH_ATTN", "FA4", FA_KV),
    ("fa4-hd256-fp8-b200", "b200", "attention", 256,
     {"kv_cache_dtype": "fp8", "inputs": SelectionInputs(non_causal=True)},
     "FLASHINFER", None, "fa_utils.py, _fa4_hd256_fallback_reason"),
    ("fa4-hd256-b200-non-causal", "b200", "attention", 256,
     {"inputs": SelectionInputs(non_causal=True), "block_size": 128},
     "FLASH_ATTN", "FA4", "fa_utils.py, uses_fa4_hd256_kernel"),
    ("fa4-hd256-block-16-b200", "b200", "attention", 256,
     {"inputs": SelectionInputs(non_causal=True), "block_size": 16},
     "FLASHINFER", None, "flash_attn.py, FlashAttentionBackend._get_fa4_hd256_block_size"),
    ("fa4-hd256-sinks-b200", "b200", "attention", 256,
     {"inputs": SelectionInputs(non_causal=True, has_sinks=True)},
     "FLASH_ATTN", "FA2", "fa_utils.py, flash_attn_supports_sinks / "
                          "_fa4_hd256_fallback_reason"),
    ("sinks-a100-triton", "a100", "attention", 64, {"inputs": SelectionInputs(has_sinks=True)},
     "TRITON_ATTN", None, FA_COMBO),
    ("sinks-h100-fa3", "h100", "attention", 64, {"inputs": SelectionInputs(has_sinks=True)},
     "FLASH_ATTN", "FA3", FA_COMBO),
    ("sinks-rtx5090-flashinfer", "rtx5090", "attention", 64,
     {"inputs": SelectionInputs(has_sinks=True)}, "FLASHINFER", None, FI_SINK),
    ("sinks-b200-flashinfer", "b200", "attention", 64,
     {"inputs": SelectionInputs(has_sinks=True)}, "FLASHINFER", None, FI_SINK),
    ("non-causal-b200-fa-first", "b200", "attention", 128,
     {"inputs": SelectionInputs(non_causal=True)}, "FLASH_ATTN", "FA4", CUDA_PRIORITY),
    ("encoder-only-b200", "b200", "attention", 128,
     {"inputs": SelectionInputs(attn_type="encoder_only")}, "FLASH_ATTN", "FA4", BASE),
    ("encoder-only-head-20-a100", "a100", "attention", 20,
     {"inputs": SelectionInputs(attn_type="encoder_only")}, "FLEX_ATTENTION", None, BASE),
    ("batch-invariant-b200", "b200", "attention", 128,
     {"inputs": SelectionInputs(batch_invariant=True)}, "FLASH_ATTN", "FA2", FA_VERSION),
    ("per-head-scales-a100", "a100", "attention", 128,
     {"inputs": SelectionInputs(per_head_kv_scales=True)}, None, None, BASE),
    ("per-head-scales-h100", "h100", "attention", 128,
     {"inputs": SelectionInputs(per_head_kv_scales=True)}, "FLASH_ATTN", "FA3",
     "flash_attn.py, FlashAttentionBackend.supports_per_head_quant_scales"),
    ("fa-version-2-h100", "h100", "attention", 128, {"inputs": SelectionInputs(fa_version=2)},
     "FLASH_ATTN", "FA2", FA_VERSION),
    ("fa-version-4-thor", "thor", "attention", 128, {"inputs": SelectionInputs(fa_version=4)},
     "FLASH_ATTN", "FA4", FA_VERSION),
    ("fa-version-3-b200-is-fa4", "b200", "attention", 128,
     {"inputs": SelectionInputs(fa_version=3, non_causal=True)}, "FLASH_ATTN", "FA4",
     FA_VERSION),
    ("triton-head-40-v100", "v100", "attention", 40, {}, "TRITON_ATTN", None, TRITON),
    ("block-48-b200", "b200", "attention", 128, {"block_size": 48}, "FLASHINFER", None, BLOCK),
    ("block-8-a100-flex", "a100", "attention", 128, {"block_size": 8}, "FLEX_ATTENTION", None,
     BLOCK),
    ("int8-per-token-head-h100", "h100", "attention", 128,
     {"kv_cache_dtype": "int8_per_token_head"}, "TRITON_ATTN", None, TRITON),
    ("nvfp4-a100", "a100", "attention", 128, {"kv_cache_dtype": "nvfp4"}, "FLASHINFER", None,
     "flashinfer.py, FlashInferBackend.supports_kv_cache_dtype"),
    ("nvfp4-head-64-a100", "a100", "attention", 64, {"kv_cache_dtype": "nvfp4"}, None, None,
     "flashinfer.py, FlashInferBackend.supports_combination"),
    ("turboquant-h100", "h100", "attention", 128, {"kv_cache_dtype": "turboquant_k8v4"},
     "TURBOQUANT", None, CUDA_PRIORITY),
    ("vit-h100", "h100", "vit_attention", 72, {}, "FLASH_ATTN", None, VIT),
    ("vit-head-36-a100", "a100", "vit_attention", 36, {}, "TRITON_ATTN", None, VIT),
    ("vit-t4-sdpa", "t4", "vit_attention", 36, {}, "TORCH_SDPA", None, VIT),
    ("mla-prefill-h100", "h100", "mla_prefill", None, {}, "FLASH_ATTN", None, MLA_PREFILL),
    ("mla-prefill-b200", "b200", "mla_prefill", None, {}, "FLASH_ATTN", None, MLA_PREFILL),
    ("mla-h100", "h100", "mla_attention", None, {}, "FLASH_ATTN_MLA", None, CUDA_PRIORITY),
    ("mla-fp8-h100-flashmla", "h100", "mla_attention", None, {"kv_cache_dtype": "fp8"},
     "FLASHMLA", None, FLASHMLA),
    ("mla-fp8-l40s-triton", "l40s", "mla_attention", None, {"kv_cache_dtype": "fp8"},
     "TRITON_MLA", None, "mla/triton_mla.py, TritonMLABackend.supported_kv_cache_dtypes"),
    ("mla-b200", "b200", "mla_attention", None, {}, "FLASHINFER_MLA", None, CUDA_PRIORITY),
    ("mla-rtx5090", "rtx5090", "mla_attention", None, {}, "TRITON_MLA", None, CUDA_PRIORITY),
    ("mla-sparse-rtx5090", "rtx5090", "mla_attention", None, {"sparse_mla": True},
     "FLASHINFER_MLA_SPARSE_SM120", None, CUDA_PRIORITY),
    ("mla-sparse-b200-tp8", "b200", "mla_attention", None,
     {"sparse_mla": True, "inputs": SelectionInputs(tensor_parallel_size=8)},
     "FLASH_ATTN_MLA_SPARSE_FA4", None, CUDA_PRIORITY),
    ("mla-sparse-b200", "b200", "mla_attention", None, {"sparse_mla": True},
     "FLASHMLA_SPARSE", None, CUDA_PRIORITY),
    ("mla-sparse-h100", "h100", "mla_attention", None, {"sparse_mla": True},
     "FLASH_ATTN_MLA_SPARSE", None, CUDA_PRIORITY),
    ("mla-sparse-fp8-b200", "b200", "mla_attention", None,
     {"sparse_mla": True, "kv_cache_dtype": "fp8"}, "FLASHINFER_MLA_SPARSE", None,
     CUDA_PRIORITY),
    ("mla-sparse-ds-mla-b200", "b200", "mla_attention", None,
     {"sparse_mla": True, "kv_cache_dtype": "fp8_ds_mla"}, "FLASHMLA_SPARSE", None,
     "mla/flashinfer_mla_sparse.py, FlashInferMLASparseTRTLLMBackend.supports_combination"),
    ("mla-sparse-fp8-h100", "h100", "mla_attention", None,
     {"sparse_mla": True, "kv_cache_dtype": "fp8"}, "FLASHMLA_SPARSE", None,
     "mla/flashmla_sparse.py, FlashMLASparseBackend.supported_kv_cache_dtypes (fp8: an alias "
     "of fp8_ds_mla); FlashAttnMLASparseBackend takes 16-bit caches only"),
]


@pytest.mark.parametrize("case_id,device,op,head,kwargs,expected,detail,source", CASES,
                         ids=[c[0] for c in CASES])
def test_ideal_equals_vllm_033(case_id, device, op, head, kwargs, expected, detail, source):
    out = explain_op_request(get_profile(device), op, head, "bfloat16" if device not in (
        "v100", "t4") else "float16", libraries="all", **kwargs).to_dict()
    (route,) = out["routes"]
    assert route["ideal"] == expected, f"{case_id}: vLLM 0.33 picks {expected} ({source})"
    if detail:
        assert route["ideal_detail"] == detail, f"{case_id} ({source})"


def test_explain_json_carries_the_new_inputs():
    inputs = SelectionInputs(has_sinks=True, attn_type="encoder", non_causal=True,
                             batch_invariant=True, per_head_kv_scales=True, fa_version=3,
                             tensor_parallel_size=4, expert_parallel=True)
    out = explain_op_request(get_profile("h100"), "attention", 128, libraries="all",
                             inputs=inputs).to_dict()
    asked = {"has_sinks": True, "attn_type": "encoder", "non_causal": True,
             "batch_invariant": True, "per_head_kv_scales": True, "fa_version": 3,
             "tensor_parallel_size": 4, "expert_parallel": True}
    assert {k: out["inputs"][k] for k in asked} == asked
    with pytest.raises(ValueError, match="attention type"):
        SelectionInputs(attn_type="cross")


def test_rules_only_inputs_have_an_ideal_but_no_route_here():
    """Batch-invariant mode at head 320 on an A100 is a hardware-rule pass for TRITON_ATTN
    alone (vLLM runs it; FlashAttention and FlashInfer lack the head size) but archserve's
    kernels lack the mode: the ideal is named, the route is empty, every reason is shown."""
    out = explain_op_request(get_profile("a100"), "attention", 320, libraries="all",
                             inputs=SelectionInputs(batch_invariant=True)).to_dict()
    (route,) = out["routes"]
    assert route["ideal"] == "TRITON_ATTN" and route["backend"] == ""
    reasons = {r["backend"]: r["reason"] for r in route["rejected"]}
    assert "batch-invariant mode is not implemented" in reasons["TRITON_ATTN"]


@pytest.mark.parametrize("device,ideal", [("a100", "TRITON_ATTN"), ("h100", "FLASH_ATTN"),
                                          ("b200", "FLASHINFER"), ("rtx5090", "FLASHINFER")])
def test_sinks_run_on_triton_where_vllm_would_pick_another_kernel(device, ideal):
    """Sinks: vLLM's pick is the ideal (FA3 on Hopper, FlashInfer's TRT-LLM kernels on
    Blackwell, Triton on Ampere); archserve's Triton kernels take them on every GPU, and
    flex refuses them as vLLM's FlexAttention does."""
    out = explain_op_request(get_profile(device), "attention", 64, libraries="installed",
                             inputs=SelectionInputs(has_sinks=True)).to_dict()
    (route,) = out["routes"]
    assert route["ideal"] == ideal and route["backend"] == "TRITON_ATTN"
    with pytest.raises(BackendError, match="attention sinks unsupported"):
        explain_op_request(get_profile(device), "attention", 64, libraries="installed",
                           inputs=SelectionInputs(has_sinks=True), override="FLEX_ATTENTION")
