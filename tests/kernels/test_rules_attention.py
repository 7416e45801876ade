"""Attention and MLA backend rules: the ideal route on every profile, and the request rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from archserve.kernels.attention.backends import flash_attn_version
from archserve.kernels.catalog import build_registry
from archserve.kernels.specs import AttentionSpec
from archserve.platform.profiles import PROFILE_IDS, get_profile

REGISTRY = build_registry()

# Ideal (hardware rules only) attention backend for head 128, fp16, per profile.
ATTENTION_IDEAL = {
    "p40": "TRITON_ATTN", "v100": "TRITON_ATTN", "t4": "TRITON_ATTN", "a100": "FLASH_ATTN", "a10": "FLASH_ATTN",
    "l40s": "FLASH_ATTN", "rtx4090": "FLASH_ATTN", "h100": "FLASH_ATTN", "h200": "FLASH_ATTN",
    "b200": "FLASHINFER", "b300": "FLASHINFER", "thor": "FLASH_ATTN", "rtx5090": "FLASH_ATTN",
    "rtx5070-laptop": "FLASH_ATTN", "gb10": "FLASH_ATTN", "mi300x": "TRITON_ATTN",
    "cpu": "TORCH_SDPA",
}
# What this build runs with every library present: FA and FlashInfer are rules only, and
# Triton (flex's compiler too) generates no Pascal code.
ATTENTION_BUILT = {pid: ("TORCH_SDPA" if pid in ("cpu", "p40") else "TRITON_ATTN")
                   for pid in PROFILE_IDS}

MLA_IDEAL = {
    "p40": "TRITON_MLA", "v100": "TRITON_MLA", "t4": "TRITON_MLA", "a100": "TRITON_MLA", "a10": "TRITON_MLA",
    "l40s": "TRITON_MLA", "rtx4090": "TRITON_MLA", "h100": "FLASH_ATTN_MLA",
    "h200": "FLASH_ATTN_MLA", "b200": "FLASHINFER_MLA", "b300": "FLASHINFER_MLA",
    "thor": "TRITON_MLA", "rtx5090": "TRITON_MLA", "rtx5070-laptop": "TRITON_MLA", "gb10": "TRITON_MLA",
    "mi300x": "TRITON_MLA", "cpu": "TORCH_REFERENCE",
}
MLA = dict(head_size=576, num_heads=128, num_kv_heads=1, use_mla=True)


def select(op: str, profile: str, spec: AttentionSpec, libraries="all"):
    return REGISTRY.select(op, get_profile(profile), spec, libraries=libraries)


def test_tables_cover_every_profile() -> None:
    assert set(ATTENTION_IDEAL) == set(MLA_IDEAL) == set(PROFILE_IDS)


@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_attention_route_on_every_profile(profile: str, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    s = select("attention", profile, AttentionSpec(head_size=128, dtype=torch.float16))
    assert (s.ideal, s.name) == (ATTENTION_IDEAL[profile], ATTENTION_BUILT[profile])


@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_mla_route_on_every_profile(profile: str) -> None:
    spec = AttentionSpec(dtype=torch.float16, **MLA)
    assert REGISTRY.ideal("mla_attention", get_profile(profile), spec) == MLA_IDEAL[profile]
    # The library MLA kernels are rules only: GPUs run archserve's Triton MLA, the CPU the
    # torch fallback; so does a T4, whose 64 KiB of shared memory cannot hold the decode's
    # latent tile for rank 512 (kernels/mla/decode_shared_memory.py).
    built = "TORCH_REFERENCE" if profile in ("cpu", "p40", "t4") else "TRITON_MLA"
    assert select("mla_attention", profile, spec).name == built


def test_triton_mla_and_the_fallback_run_the_library_kernels_are_rules_only() -> None:
    assert REGISTRY.get("mla_attention", "TORCH_REFERENCE").implemented
    assert REGISTRY.get("mla_attention", "TRITON_MLA").implemented
    assert REGISTRY.get("mla_attention", "TRITON_MLA").graph_capturable
    assert not REGISTRY.get("mla_attention", "FLASHMLA").implemented


def test_triton_mla_rules_follow_vllm_033() -> None:
    """mla/triton_mla.py (TritonMLABackend): fp16/bf16, a bf16 or e4m3 latent cache (no
    fp16 or e5m2 one), MLACommonBackend's head sizes 320 and 576; blocks of 16."""
    def reason(**fields) -> str | None:
        spec = AttentionSpec(**{"dtype": torch.bfloat16, **MLA, **fields})
        return REGISTRY.get("mla_attention", "TRITON_MLA").hardware_rule(get_profile("h200"),
                                                                         spec)

    assert reason() is None and reason(kv_cache_dtype="fp8") is None
    assert reason(head_size=320, kv_lora_rank=256) is None
    assert "fp8_e5m2" in reason(kv_cache_dtype="fp8_e5m2")
    assert "float16" in reason(kv_cache_dtype="float16")
    assert "float32" in reason(dtype=torch.float32)
    assert "head size 40" in reason(head_size=40, kv_lora_rank=32, qk_rope_head_dim=8)
    assert "multiple of 16" in reason(block_size=8)
    assert "CUDA or ROCm" in REGISTRY.get("mla_attention", "TRITON_MLA").hardware_rule(
        get_profile("cpu"), AttentionSpec(dtype=torch.bfloat16, **MLA))


def test_sparse_mla_order_depends_on_kv_dtype_and_heads() -> None:
    indexer = dict(mla_sparse=True, index_topk=2048, index_head_dim=128, index_num_heads=64)
    sparse = AttentionSpec(dtype=torch.bfloat16, **indexer, **MLA)

    def ideal(profile: str, spec: AttentionSpec) -> str | None:
        return REGISTRY.ideal("mla_attention", get_profile(profile), spec)

    # vLLM 0.33 platforms/cuda.py, _get_backend_priorities (use_mla): on the SM100 family
    # a 16-bit cache prefers FlashMLA sparse, or FA4 sparse at <= 16 heads; a quantized
    # cache FlashInfer sparse. Hopper tries FA sparse first; SM12x has its own FlashInfer.
    assert ideal("b200", sparse) == "FLASHMLA_SPARSE"
    few_heads = AttentionSpec(dtype=torch.bfloat16, **indexer, **{**MLA, "num_heads": 16})
    assert ideal("b200", few_heads) == "FLASH_ATTN_MLA_SPARSE_FA4"
    # FA4 sparse needs top-k in whole 128-key tiles: FlashInfer's sparse kernels next.
    odd_topk = replace(few_heads, index_topk=2000)
    assert ideal("b200", odd_topk) == "FLASHINFER_MLA_SPARSE"
    # An fp8 cache (archserve calls vLLM's "fp8" fp8_e4m3; fp8_ds_mla is FlashMLA's format,
    # which FlashInfer's SM100 kernels refuse).
    for kv in ("fp8", "fp8_e4m3"):
        fp8 = replace(sparse, kv_cache_dtype=kv)
        assert ideal("b200", fp8) == "FLASHINFER_MLA_SPARSE"
        assert ideal("h100", fp8) == "FLASHMLA_SPARSE"
    assert ideal("b200", replace(sparse, kv_cache_dtype="fp8_ds_mla")) == "FLASHMLA_SPARSE"
    assert ideal("h100", sparse) == "FLASH_ATTN_MLA_SPARSE"
    # fp16: FlashMLA sparse and FlashInfer's SM90 kernel take bf16 only; FA3 sparse fp16.
    assert ideal("h100", replace(sparse, dtype=torch.float16)) == "FLASH_ATTN_MLA_SPARSE"
    assert ideal("h100", replace(sparse, dtype=torch.float16,
                                 kv_cache_dtype="fp8_e4m3")) == "TRITON_MLA_SPARSE"
    assert ideal("rtx5090", sparse) == "FLASHINFER_MLA_SPARSE_SM120"
    # SM12x's FlashInfer kernel is built for top-2048 only: archserve's Triton kernel then.
    assert ideal("rtx5090", odd_topk) == "TRITON_MLA_SPARSE"
    # No vLLM sparse kernel before Hopper: archserve's runs (the route on every GPU).
    assert ideal("a100", sparse) == "TRITON_MLA_SPARSE"
    assert ideal("cpu", sparse) == "TORCH_REFERENCE"


@pytest.mark.parametrize("profile,head,version", [
    ("a100", 128, 2), ("h100", 128, 3), ("h100", 256, 3), ("b200", 128, 4), ("b200", 256, 4),
    ("b200", 160, 2), ("b200", 192, 2), ("rtx5090", 128, 2), ("gb10", 64, 2),
])
def test_flash_attention_version_by_device(profile: str, head: int, version: int) -> None:
    assert flash_attn_version(get_profile(profile), AttentionSpec(head_size=head)) == version


def test_fa4_accepts_192_with_a_128_value_head() -> None:
    spec = AttentionSpec(head_size=192, v_head_dim=128, use_mla=True)
    assert flash_attn_version(get_profile("b200"), spec) == 4


def reason(profile: str, name: str, spec: AttentionSpec) -> str | None:
    return REGISTRY.get("attention", name).hardware_rule(get_profile(profile), spec)


def test_fp8_kv_cache_rules() -> None:
    fp8 = AttentionSpec(head_size=128, dtype=torch.float16, kv_cache_dtype="fp8")
    assert reason("h100", "FLASH_ATTN", fp8) is None
    assert "FA3" in reason("a100", "FLASH_ATTN", fp8)
    assert "FA2" in reason("rtx5090", "FLASH_ATTN", fp8)
    # vLLM 0.33 keeps fp8 below SM89: Triton and FlashInfer list it with no capability check.
    assert reason("t4", "TRITON_ATTN", fp8) is None
    assert reason("l40s", "TRITON_ATTN", fp8) is None
    assert reason("l40s", "FLASHINFER", fp8) is None
    assert reason("a100", "FLASHINFER", fp8) is None
    # The torch backends dequantize an fp8 cache as they gather it.
    assert reason("h100", "FLEX_ATTENTION", fp8) is None
    assert reason("h100", "TORCH_SDPA", fp8) is None
    assert reason("h100", "TORCH_REFERENCE", fp8) is None


def test_head_size_rules() -> None:
    assert reason("h100", "FLASH_ATTN", AttentionSpec(head_size=72)) is None
    assert "head size 260" in reason("h100", "FLASH_ATTN", AttentionSpec(head_size=260))
    assert "head size 68" in reason("h100", "FLASH_ATTN", AttentionSpec(head_size=68))
    assert "head size 96" in reason("h100", "FLASHINFER", AttentionSpec(head_size=96))
    assert reason("h100", "TRITON_ATTN", AttentionSpec(head_size=80)) is None
    assert reason("h100", "TRITON_ATTN", AttentionSpec(head_size=72)) is None
    assert "head size 24" in reason("h100", "TRITON_ATTN", AttentionSpec(head_size=24))
    # An odd head size runs on Triton (any size >= 32), below that on FLEX.
    s = REGISTRY.select("attention", get_profile("h100"), AttentionSpec(head_size=72),
                        libraries="all")
    assert s.ideal == "FLASH_ATTN" and s.name == "TRITON_ATTN"
    s = REGISTRY.select("attention", get_profile("h100"), AttentionSpec(head_size=24),
                        libraries="all")
    assert s.name == "FLEX_ATTENTION"


def test_block_size_constrains_the_choice() -> None:
    assert "multiple of 16" in reason("h100", "FLASH_ATTN", AttentionSpec(128, block_size=8))
    assert reason("h100", "FLASH_ATTN", AttentionSpec(128, block_size=48)) is None
    # vLLM 0.33 (v1/attention/backend.py, supports_block_size): a multiple of an advertised
    # size is accepted, so FlashInfer's 16 admits 48 and 256.
    assert reason("b200", "FLASHINFER", AttentionSpec(128, block_size=48)) is None
    assert "multiple of 16" in reason("b200", "FLASHINFER", AttentionSpec(128, block_size=8))
    s = REGISTRY.select("attention", get_profile("b200"), AttentionSpec(128, block_size=48),
                        libraries="all")
    assert s.ideal == "FLASHINFER"


def test_bf16_on_a_device_without_it_is_rejected_by_gpu_kernels() -> None:
    assert reason("v100", "TRITON_ATTN", AttentionSpec(128, dtype=torch.bfloat16)) == \
        "bfloat16 needs SM80+, device is SM70"


def test_soft_cap_keeps_the_cpu_default() -> None:
    capped = AttentionSpec(128, logit_soft_cap=50.0)
    assert reason("cpu", "TORCH_SDPA", capped) is None
    s = REGISTRY.select("attention", get_profile("cpu"), capped, libraries="all")
    assert s.name == "TORCH_SDPA"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert reason("cpu", "TRITON_ATTN", AttentionSpec(128)) == \
        "needs a GPU (runs on CPU only under TRITON_INTERPRET=1)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert reason("cpu", "TRITON_ATTN", AttentionSpec(128)) is None


def test_mla_spec_is_not_served_by_standard_backends() -> None:
    assert "MLA" in reason("h100", "TRITON_ATTN", AttentionSpec(**MLA))


def test_preferred_block_sizes() -> None:
    assert REGISTRY.get("attention", "FLASH_ATTN").preferred_block_size == 16
    assert REGISTRY.get("mla_attention", "FLASHMLA").preferred_block_size == 64
    assert REGISTRY.get("mla_attention", "CUTLASS_MLA").preferred_block_size == 128


def test_mla_prefill_shows_vllms_choice_and_what_runs_here() -> None:
    from archserve.routing.explain import explain_op_request

    for profile, runs in (("h200", "TRITON_ATTN"), ("cpu", "TORCH_REFERENCE")):
        out = explain_op_request(get_profile(profile), "mla_prefill", libraries="all")
        route = out.routes[0]
        assert out.not_loadable is None and route.backend == runs
        assert route.ideal == ("FLASH_ATTN" if profile == "h200" else None)
