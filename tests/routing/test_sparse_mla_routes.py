"""explain on DeepSeek-V3.2 and GLM-5 configs (their real defaults from transformers' config
classes): vLLM 0.33's sparse-MLA choice as the ideal, TRITON_MLA_SPARSE as the route on every
GPU whose shared memory holds its decode tile, TORCH_REFERENCE on the CPU and where it does
not, and the fp8 caches' decisions."""

from __future__ import annotations

import pytest

from archserve.platform.profiles import get_profile
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import read_model_summary


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    out = {}
    for name, cls, arch in (("v32", DeepseekV32Config, "DeepseekV32ForCausalLM"),
                            ("glm5", GlmMoeDsaConfig, "GlmMoeDsaForCausalLM")):
        config = cls(num_hidden_layers=4)
        config.architectures = [arch]
        path = tmp_path_factory.mktemp(name)
        config.save_pretrained(path)
        out[name] = read_model_summary(str(path))
    return out


def attention(device: str, summary, kv: str = "auto"):
    explanation = explain_model(get_profile(device), summary, "bfloat16", kv,
                                libraries="all")
    assert explanation.not_loadable is None, explanation.not_loadable
    route = next(r for r in explanation.routes if r.layer == "attention")
    return route, {d.what: d for d in explanation.decisions}


@pytest.mark.parametrize("device,ideal", [
    ("rtx5090", "FLASHINFER_MLA_SPARSE_SM120"),    # SM12x: its own FlashInfer kernel
    ("h100", "FLASH_ATTN_MLA_SPARSE"),             # Hopper, 16-bit cache: FA3 sparse first
    ("b200", "FLASHMLA_SPARSE"),                   # SM100, 16-bit cache, 128 heads
    ("a100", "TRITON_MLA_SPARSE"),                 # no vLLM sparse kernel before Hopper
])
def test_v32_ideal_is_vllms_and_the_route_is_triton(configs, device, ideal):
    summary = configs["v32"]
    assert summary.mla_sparse and summary.index_topk == 2048 and summary.index_num_heads == 64
    route, _ = attention(device, summary)
    assert (route.op, route.backend, route.ideal) == ("mla_attention", "TRITON_MLA_SPARSE",
                                                      ideal)


def test_a_gpu_whose_shared_memory_cannot_hold_the_decode_tile_runs_the_reference(configs):
    """The compile sweep's finding (tests/compile_sweep.py): below SM80 the decode's latent
    tile for rank 512 takes 100 KiB of shared memory at 32 tokens, 68 KiB at 16: a V100
    (96 KiB) runs 16-token tiles, a T4 (64 KiB) the reference."""
    assert attention("v100", configs["v32"])[0].backend == "TRITON_MLA_SPARSE"
    route, _ = attention("t4", configs["v32"])
    assert route.backend == "TORCH_REFERENCE"
    reason = next(r.reason for r in route.rejected if r.backend == "TRITON_MLA_SPARSE")
    assert reason == ("below SM80 its decode's smallest latent tile for kv_lora_rank 512 "
                      "needs 68 KiB of shared memory, the GPU has 64 KiB")
    # An fp8_ds_mla cache's decode takes 102 KiB from SM80: an A100 holds it, an L40S not.
    assert attention("a100", configs["v32"], "fp8")[0].backend == "TRITON_MLA_SPARSE"
    route, _ = attention("l40s", configs["v32"], "fp8")
    assert route.backend == "TORCH_REFERENCE"
    assert "fp8_ds_mla cache needs 102 KiB of shared memory, the GPU has 99 KiB" in next(
        r.reason for r in route.rejected if r.backend == "TRITON_MLA_SPARSE")


def test_fp8_caches_and_glm5s_sm100_default(configs):
    # --kv-cache-dtype fp8: FlashInfer's sparse kernels on SM100, FlashMLA sparse on Hopper
    # (vLLM serves it as fp8_ds_mla, as archserve's route keeps it).
    route, decisions = attention("b200", configs["v32"], "fp8")
    assert route.ideal == "FLASHINFER_MLA_SPARSE" and route.backend == "TRITON_MLA_SPARSE"
    assert "fp8_ds_mla" in decisions["kv_cache_dtype"].reason
    assert attention("h100", configs["v32"], "fp8")[0].ideal == "FLASHMLA_SPARSE"
    # vLLM 0.33 gives GLM-MoE-DSA an fp8 cache on the SM100 family for "auto".
    route, decisions = attention("b200", configs["glm5"])
    assert decisions["kv_cache_dtype"].chosen == "fp8_e4m3"
    assert route.ideal == "FLASHINFER_MLA_SPARSE"
    assert attention("h100", configs["glm5"])[1]["kv_cache_dtype"].chosen == "auto"


def test_cpu_runs_the_torch_reference_and_dense_backends_say_why_not(configs):
    route, _ = attention("cpu", configs["v32"])
    assert route.backend == "TORCH_REFERENCE"
    route, _ = attention("h100", configs["v32"])
    reasons = {r.backend: r.reason for r in route.rejected}
    assert "sparse MLA" in reasons["TRITON_MLA"]
