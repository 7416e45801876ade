"""dtype decisions, and explain for single ops and for model configs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from archserve.platform.device import features_for
from archserve.platform.profiles import get_profile
from archserve.routing.dtypes import resolve_dtype, resolve_kv_cache_dtype
from archserve.routing.explain import explain_model, explain_op_request
from archserve.routing.model_summary import read_model_summary


@pytest.mark.parametrize("profile,requested,chosen", [
    ("v100", "bfloat16", torch.float16), ("t4", "bf16", torch.float16),
    ("a100", "bfloat16", torch.bfloat16), ("v100", "auto", torch.float16),
    ("h100", "auto", torch.bfloat16), ("cpu", "auto", torch.bfloat16),
    ("cpu", "half", torch.float16), ("h100", torch.float32, torch.float32),
])
def test_resolve_dtype(profile: str, requested, chosen: torch.dtype) -> None:
    dtype, decisions = resolve_dtype(get_profile(profile), requested)
    assert dtype == chosen
    assert decisions[0].what == "dtype"


def test_bf16_degradation_is_a_recorded_decision() -> None:
    _, (decision,) = resolve_dtype(get_profile("v100"), "bfloat16")
    assert (decision.requested, decision.chosen) == ("bfloat16", "float16")
    assert "SM80" in decision.reason and "SM70" in decision.reason


def test_auto_keeps_a_float16_checkpoint_on_gpus() -> None:
    assert resolve_dtype(get_profile("h100"), "auto", "float16")[0] == torch.float16


@pytest.mark.parametrize("flags,checkpoint,chosen", [
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, None, torch.bfloat16),
    ({"avx2", "fma", "amx_bf16", "amx_int8", "amx_tile"}, "float16", torch.bfloat16),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "bfloat16",
     torch.float32),
    (set(), "float32", torch.float32),
])
def test_auto_on_a_cpu_is_bfloat16_where_it_multiplies_bfloat16(flags, checkpoint, chosen
                                                                 ) -> None:
    """As vLLM's CPU backend, bfloat16 where AVX-512 BF16 or AMX multiply it (a float16
    checkpoint too); float32 where bfloat16 would be emulated. The decision says why."""
    cpu = dataclasses.replace(get_profile("cpu"),
                              features=features_for("cpu", None, cpu_flags=frozenset(flags)))
    dtype, (decision,) = resolve_dtype(cpu, "auto", checkpoint)
    assert dtype == chosen
    assert decision.chosen == str(chosen).removeprefix("torch.")
    assert ("native bfloat16" in decision.reason) and (
        ("without" in decision.reason) == (chosen == torch.float32))
    # An explicit choice is kept either way.
    assert resolve_dtype(cpu, "float32", checkpoint)[0] == torch.float32
    assert resolve_dtype(cpu, "bfloat16", checkpoint)[0] == torch.bfloat16


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        resolve_dtype(get_profile("h100"), "int3")


def test_fp8_kv_cache() -> None:
    assert resolve_kv_cache_dtype(get_profile("h100"), "fp8")[0] == "fp8_e4m3"
    assert resolve_kv_cache_dtype(get_profile("l40s"), "fp8_e5m2")[0] == "fp8_e5m2"
    # vLLM 0.33 keeps fp8 below SM89 (FlashInfer on SM8x, Triton on SM7x read it):
    # archserve keeps it on every CUDA GPU and says the kernel widens the bytes.
    for profile in ("a100", "t4", "v100"):
        kv, (decision,) = resolve_kv_cache_dtype(get_profile(profile), "fp8")
        assert kv == "fp8_e4m3" and "kept" in decision.reason
    assert resolve_kv_cache_dtype(get_profile("cpu"), "fp8")[0] == "auto"
    # vLLM's other names pass through as rules only; unknown names are refused.
    kv, (decision,) = resolve_kv_cache_dtype(get_profile("h100"), "int8_per_token_head")
    assert kv == "int8_per_token_head" and decision.reason.startswith("refused: no kernel in this build")
    assert resolve_kv_cache_dtype(get_profile("h100"), "bfloat16")[0] == "auto"
    with pytest.raises(ValueError):
        resolve_kv_cache_dtype(get_profile("h100"), "int4")


@pytest.mark.parametrize("profile,ideal,detail", [
    ("v100", "TRITON_ATTN", ""), ("h100", "FLASH_ATTN", "FA3"), ("b200", "FLASHINFER", ""),
    ("rtx5090", "FLASH_ATTN", "FA2"),
])
def test_done_when_routes(profile: str, ideal: str, detail: str) -> None:
    out = explain_op_request(get_profile(profile), "attention", 128, "bfloat16",
                                    libraries="all").to_dict()
    (route,) = out["routes"]
    assert route["ideal"] == ideal and route["ideal_detail"] == detail
    assert route["backend"] == "TRITON_ATTN"
    json.dumps(out)


def test_v100_json_shape_records_bf16_to_fp16() -> None:
    out = explain_op_request(get_profile("v100"), "attention", 128, "bfloat16",
                                    libraries="all").to_dict()
    assert out["device"] == {"id": "v100", "name": "Tesla V100-SXM2-32GB", "platform": "cuda",
                             "capability": [7, 0]}
    assert out["dtype"] == "float16"
    assert {"what": "dtype", "requested": "bfloat16", "chosen": "float16"}.items() <= \
        out["decisions"][0].items()
    assert [r["backend"] for r in out["routes"][0]["rejected"]] == ["FLASH_ATTN", "FLASHINFER"]


def test_mla_op_assumes_deepseek_dims() -> None:
    out = explain_op_request(get_profile("b200"), "mla_attention", None,
                                    libraries="all").to_dict()
    assert out["routes"][0]["ideal"] == "FLASHINFER_MLA"


def _write_config(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_explain_dense_model(tmp_path) -> None:
    path = _write_config(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"],
                         hidden_size=576,
                         num_attention_heads=9, num_key_value_heads=3, torch_dtype="bfloat16")
    summary = read_model_summary(path)
    assert summary.head_size == 64 and not summary.is_moe and summary.quantization is None
    out = explain_model(get_profile("h100"), summary, libraries="all").to_dict()
    assert [r["layer"] for r in out["routes"]] == ["attention", "linear (qkv, o, mlp)", "lm_head"]
    assert out["routes"][0]["ideal"] == "FLASH_ATTN"
    assert out["routes"][1]["backend"] == "TRITON_SKINNY_GEMM"


def test_explain_fp8_moe_mla_model(tmp_path) -> None:
    path = _write_config(
        tmp_path, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        qk_rope_head_dim=64, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    summary = read_model_summary(path)
    assert summary.use_mla and summary.head_size == 576 and summary.num_experts == 256
    out = explain_model(get_profile("h100"), summary, libraries="all").to_dict()
    routes = {r["layer"]: r for r in out["routes"]}
    assert routes["attention"]["op"] == "mla_attention"
    assert routes["attention"]["ideal"] == "FLASH_ATTN_MLA"
    # vLLM 0.33 kernels/linear: FlashInfer's Hopper block-scale GEMM with DeepGEMM above
    # its batch size comes first for bf16 block FP8.
    assert routes["linear (qkv, o, mlp)"]["ideal"] == "FLASHINFER_DEEPGEMM_BLOCK_FP8"
    # vLLM 0.33 oracle/fp8.py _get_priority_backends: Hopper block FP8 with EP = 1 moves
    # Triton to the front (FlashInfer CUTLASS under EP > 1).
    assert routes["moe experts"]["ideal"] == "TRITON_FUSED_MOE"
    # Block-FP8 DeepSeek-V3 loads (experts included): each layer shows what runs here.
    assert out["not_loadable"] is None
    assert routes["attention"]["backend"] == "TRITON_MLA"
    assert routes["moe experts"]["backend"] == "TRITON_FUSED_MOE"
    assert routes["linear (qkv, o, mlp)"]["backend"] == "TRITON_BLOCK_FP8"


def test_explain_gguf_model(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    summary = read_model_summary(str(path))
    assert (summary.head_size, summary.num_kv_heads, summary.quantization) == (64, 2, "gguf")
    out = explain_model(get_profile("v100"), summary, libraries="all").to_dict()
    # Kept quantized on GPUs: the weight-only kernel reads the GGUF blocks.
    assert out["routes"][1]["backend"] == "TRITON_WEIGHT_ONLY"
    assert any(d["what"] == "quantization" for d in out["decisions"])
    # A float32 model expands it at load: float32 stays exact.
    cpu = explain_model(get_profile("cpu"), summary, dtype="float32", libraries="all").to_dict()
    assert cpu["routes"][1]["backend"] == "TORCH_MATMUL"
    assert "AVX-512 BF16" in cpu["device"]["cpu_isa"]
    # A bfloat16 one (auto, on a CPU with AVX-512 BF16) keeps it packed on a CPU whose
    # vector ISA torch's weight-only kernels take (AVX2) ...
    cpu = explain_model(get_profile("cpu"), summary, libraries="all").to_dict()
    assert cpu["dtype"] == "bfloat16"
    assert cpu["routes"][1]["backend"] == "CPU_WEIGHT_ONLY"
    # ... and expands it on one without, where they would run scalar code.
    plain = dataclasses.replace(get_profile("cpu"), features=features_for("cpu", None))
    cpu = explain_model(plain, summary, dtype="bfloat16", libraries="all").to_dict()
    assert cpu["routes"][1]["backend"] == "TORCH_MATMUL"
    assert cpu["device"]["cpu_isa"] == []


def test_explain_reads_sliding_windows_as_the_engine_does(tmp_path) -> None:
    """Qwen2 slides only in the layers from max_window_layers on: with all 4 layers below
    it, no layer slides. The engine's loader knows that; explain once read config.json on
    its own and routed for a 4096-token window."""
    from archserve.loader.config import load_hf_model_config

    path = _write_config(tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                         hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, use_sliding_window=True, sliding_window=4096,
                         max_window_layers=4)
    assert load_hf_model_config(path).sliding_window is None
    assert read_model_summary(path).sliding_window is None
