"""explain on a DeepSeek V4 config (V4-Flash's sizes from transformers' config class, its
three layer kinds): one attention route per kind, vLLM's V4 backend as the ideal
(FLASHMLA_SPARSE_DSV4 on Hopper and the SM100 family, FLASHINFER_MLA_SPARSE_DSV4 on SM12x
with its fp8 cache), TRITON_MLA_SPARSE_DSV4 as the route on every GPU, TORCH_REFERENCE on the
CPU; an fp8 cache, which no V4 route of this build reads, refuses the model up front."""

from __future__ import annotations

import pytest

from archserve.kernels.compressed_attention.layout import CSA, HCA, SLIDING
from archserve.platform.profiles import get_profile
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import read_model_summary

KIND_NAMES = ("sliding window only", "compressed sparse", "heavily compressed")


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(num_hidden_layers=6,
                              layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA],
                              mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3)
    config.architectures = ["DeepseekV4ForCausalLM"]
    path = tmp_path_factory.mktemp("v4")
    config.save_pretrained(path)
    return read_model_summary(str(path))


def attention_routes(device: str, summary, kv: str = "auto"):
    explanation = explain_model(get_profile(device), summary, "bfloat16", kv, libraries="all")
    routes = [r for r in explanation.routes if r.layer.startswith("attention")]
    return explanation, routes


def test_one_route_per_layer_kind(summary):
    _, routes = attention_routes("h200", summary)
    assert [r.op for r in routes] == ["mla_attention"] * 3
    for route, name in zip(routes, KIND_NAMES, strict=True):
        assert name in route.layer
    assert "top-512" in routes[1].layer and "128 tokens" in routes[2].layer
    assert not any("prefill" in r.layer for r in routes)


@pytest.mark.parametrize("device,ideal", [
    ("h200", "FLASHMLA_SPARSE_DSV4"),     # Hopper: FlashMLA's V4 kernels
    ("b200", "FLASHMLA_SPARSE_DSV4"),     # SM100: FlashMLA unless FlashInfer is named
    ("rtx5090", "TRITON_MLA_SPARSE_DSV4"),  # SM12x's FlashInfer kernel needs an fp8 cache
    ("a100", "TRITON_MLA_SPARSE_DSV4"),   # no vLLM V4 kernel before Hopper
])
def test_every_gpu_routes_triton_beside_vllms_ideal(summary, device, ideal):
    explanation, routes = attention_routes(device, summary)
    assert explanation.not_loadable is None, explanation.not_loadable
    for route in routes:
        assert (route.backend, route.ideal) == ("TRITON_MLA_SPARSE_DSV4", ideal), route


def test_a_t4_runs_the_reference_where_the_kernels_outgrow_its_shared_memory(summary):
    """Below SM80 the Triton kernels stage their operands through shared memory: 96 KiB at
    V4's 512-channel heads (the compile sweep measures it), which a V100 has and a T4 (64
    KiB) has not."""
    explanation, routes = attention_routes("t4", summary)
    assert explanation.not_loadable is None, explanation.not_loadable
    assert {r.backend for r in routes} == {"TORCH_REFERENCE"}
    reasons = {r.backend: r.reason for r in routes[1].rejected}
    assert reasons["TRITON_MLA_SPARSE_DSV4"] == (
        "below SM80 its kernels at head size 512 need 96 KiB of shared memory, the GPU has "
        "64 KiB")
    _, routes = attention_routes("v100", summary)
    assert {r.backend for r in routes} == {"TRITON_MLA_SPARSE_DSV4"}


def test_sm120s_fp8_ideal_and_the_refusal_of_fp8(summary):
    """--kv-cache-dtype fp8_ds_mla: FlashInfer's SM120 kernel is vLLM's choice; no route of
    this build keeps V4's cache in fp8, so the model is refused with the reasons."""
    explanation, routes = attention_routes("rtx5090", summary, "fp8_ds_mla")
    assert {r.ideal for r in routes} == {"FLASHINFER_MLA_SPARSE_DSV4"}
    assert explanation.not_loadable is not None
    assert "keeps DeepSeek V4's cache in the model dtype" in explanation.not_loadable
    # SM100: FlashMLA reads fp8_ds_mla; FlashInfer's SM100 kernels read a per-tensor fp8.
    explanation, routes = attention_routes("b200", summary, "fp8_ds_mla")
    reasons = {r.backend: r.reason for r in routes[1].rejected}
    assert routes[1].ideal == "FLASHMLA_SPARSE_DSV4"
    assert "not fp8_ds_mla" in reasons["FLASHINFER_MLA_SPARSE_DSV4"]
    assert "fp8_ds_mla KV cache unsupported" in reasons["TRITON_MLA_SPARSE_DSV4"]


def test_cpu_runs_the_torch_reference_and_mla_backends_refuse_v4(summary):
    _, routes = attention_routes("cpu", summary)
    assert {r.backend for r in routes} == {"TORCH_REFERENCE"}
    from archserve.kernels.catalog import default_registry
    from archserve.kernels.specs import AttentionSpec
    spec = AttentionSpec(head_size=512, num_heads=64, num_kv_heads=1, use_mla=True,
                         mla_sparse=True, compress_rate=4)
    reason = default_registry().get("mla_attention", "FLASHINFER_MLA_SPARSE_SM120").check(
        get_profile("rtx5090"), spec, "all")
    assert "not a DeepSeek V4 attention backend" in reason


def test_kv_block_size_holds_whole_groups_of_every_rate(tmp_path_factory):
    # V4-Flash compresses 4 (CSA) and 128 (HCA) tokens an entry: the Triton route's 256-token
    # blocks, the reference's 16 rounded up to 128, a user's 64 refused.
    from transformers import DeepseekV4Config

    from archserve.engine.config import EngineConfig
    from archserve.engine.runner_setup import peek_model_config
    from archserve.engine.startup import kv_block_size
    from archserve.kernels.catalog import build_registry

    config = DeepseekV4Config(num_hidden_layers=2, layer_types=[CSA, HCA],
                              mlp_layer_types=["moe"] * 2)
    config.architectures = ["DeepseekV4ForCausalLM"]
    path = str(tmp_path_factory.mktemp("v4_blocks"))
    config.save_pretrained(path)
    model_config, _ = peek_model_config(path)
    registry = build_registry()
    triton = registry.get("mla_attention", "TRITON_MLA_SPARSE_DSV4")
    reference = registry.get("mla_attention", "TORCH_REFERENCE")
    assert kv_block_size(EngineConfig(model=path), triton, model_config) == 256
    assert kv_block_size(EngineConfig(model=path), reference, model_config) == 128
    assert kv_block_size(EngineConfig(model=path, block_size=384), triton, model_config) == 384
    with pytest.raises(ValueError, match="multiple of 128"):
        kv_block_size(EngineConfig(model=path, block_size=64), triton, model_config)
