"""What a model's config adds to attention selection (sinks, causality, encoder kinds, the
checkpoint's KV cache, a vision encoder), read once and asked by explain and the engine alike."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoConfig

from archserve.kernels.specs import KV_CACHE_DTYPES, RUNNABLE_KV_CACHE_DTYPES
from archserve.models.attention_facts import attention_facts, checkpoint_kv_cache
from archserve.platform.profiles import get_profile
from archserve.routing.dtypes import kv_cache_refusal, resolve_kv_cache_dtype
from archserve.routing.explain import SelectionInputs, explain_model
from archserve.routing.model_summary import summary_from_hf_config

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=1024,
             intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
             num_hidden_layers=2, vocab_size=1000, torch_dtype="bfloat16")


def _facts(model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **fields)
    return attention_facts(config, fields.get("quantization_config"))


def test_sinks_come_from_the_model_type_or_a_flag():
    assert _facts("gpt_oss").has_sinks
    assert _facts("llama", attention_sinks=True).has_sinks
    assert _facts("qwen2", add_swa_attention_sink_bias=True).has_sinks
    # Granite's SWA checkpoints carry sinks without a flag; the flag can still say no.
    assert _facts("granite", layer_types=["sliding_attention", "full_attention"],
                  num_hidden_layers=2).has_sinks
    assert not _facts("granite", layer_types=["sliding_attention", "full_attention"],
                      num_hidden_layers=2, attention_sinks=False).has_sinks
    assert not _facts("llama").has_sinks and not _facts("granite").has_sinks


def test_causality_and_encoder_kinds():
    assert _facts("llama").attn_type == "decoder"
    assert _facts("qwen2", is_causal=False).attn_type == "encoder_only"
    assert _facts("gemma3_text", use_bidirectional_attention=True).attn_type == "encoder_only"
    facts = _facts("t5")
    assert facts.attn_type == "encoder_decoder"
    assert facts.spec_fields()["attn_type"] == "decoder"   # the decoder's self-attention


@pytest.mark.parametrize("config,expected", [
    (None, (None, False)),
    ({"quant_method": "fp8"}, (None, False)),
    ({"quant_method": "compressed-tensors",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
     ("fp8", False)),
    ({"quant_method": "compressed-tensors",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"}},
     ("fp8", True)),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
     ("fp8_e4m3", False)),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4"},
     ("nvfp4", False)),
    ({"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 4, "type": "float"}},
     ("nvfp4", False)),
])
def test_the_checkpoint_kv_cache(config, expected):
    assert checkpoint_kv_cache(config) == expected


def test_auto_takes_the_checkpoint_kv_cache_and_an_explicit_choice_wins():
    h100 = get_profile("h100")
    kv, (decision,) = resolve_kv_cache_dtype(h100, "auto", "fp8")
    assert kv == "fp8_e4m3" and "checkpoint" in decision.reason
    assert resolve_kv_cache_dtype(h100, "bfloat16", "fp8")[0] == "auto"


def test_every_kv_dtype_archserve_cannot_read_is_refused_with_what_reads_it_in_vllm():
    for name in KV_CACHE_DTYPES:
        reason = kv_cache_refusal(name)
        assert (reason is None) == (name in RUNNABLE_KV_CACHE_DTYPES), name
        if reason:
            assert "vLLM 0.33" in reason or "no CUDA backend" in reason, reason


def _explain(device: str, config: dict, **kwargs):
    summary = summary_from_hf_config(config)
    return explain_model(get_profile(device), summary, libraries="all", **kwargs)


def test_a_config_with_sinks_gets_vllms_sink_ideal():
    out = _explain("h100", dict(LLAMA, head_dim=64, attention_sinks=True))
    assert out.inputs.has_sinks
    (attention,) = [r for r in out.routes if r.layer == "attention"]
    assert (attention.ideal, attention.ideal_detail) == ("FLASH_ATTN", "FA3")
    assert _explain("a100", dict(LLAMA, head_dim=64, attention_sinks=True)
                    ).routes[0].ideal == "TRITON_ATTN"


def test_a_bidirectional_decoder_is_refused_with_the_reason():
    out = _explain("h100", dict(LLAMA, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                is_causal=False))
    assert out.inputs.attn_type == "encoder_only"
    assert "encoder_only attention is not implemented" in out.not_loadable
    assert all(r.backend == "" for r in out.routes)
    assert out.routes[0].ideal == "FLASH_ATTN"


def test_per_head_kv_scales_and_the_checkpoint_cache_reach_selection():
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "config_groups": {"g": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "float", "strategy": "channel"}}},
             "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"}}
    out = _explain("h100", dict(LLAMA, quantization_config=quant))
    assert out.inputs.per_head_kv_scales
    kv = next(d for d in out.decisions if d.what == "kv_cache_dtype")
    assert kv.chosen == "fp8_e4m3"
    assert out.routes[0].ideal == "FLASH_ATTN"      # FA3 takes per-head scales
    assert _explain("a100", dict(LLAMA, quantization_config=quant)).routes[0].ideal is None


def test_an_mla_model_shows_its_prefill_selection_apart_from_decode():
    deepseek = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                    num_attention_heads=16, num_hidden_layers=2, n_routed_experts=8,
                    num_experts_per_tok=2, kv_lora_rank=512, qk_rope_head_dim=64,
                    qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
                    vocab_size=1000, torch_dtype="bfloat16")
    routes = {r.layer: r for r in _explain("b200", deepseek).routes}
    assert routes["attention"].ideal == "FLASHINFER_MLA"
    prefill = routes["attention (prefill)"]
    assert (prefill.op, prefill.ideal) == ("mla_prefill", "FLASH_ATTN")
    # What runs the prompts here: archserve's Triton prefill over expanded K/V.
    assert prefill.backend == "TRITON_ATTN"
    # vLLM's dimensions rule: (192, 64, 256) puts TRT-LLM's ragged kernel first.
    wide = dict(deepseek, qk_nope_head_dim=192, v_head_dim=256)
    routes = {r.layer: r for r in _explain("b200", wide).routes}
    assert routes["attention (prefill)"].ideal == "TRTLLM_RAGGED"
    assert {r.layer: r for r in _explain("h100", wide).routes}[
        "attention (prefill)"].ideal == "FLASH_ATTN"
    odd = dict(deepseek, qk_nope_head_dim=96)      # no prefill kernel of vLLM takes it
    prefill = {r.layer: r for r in _explain("h100", odd).routes}["attention (prefill)"]
    assert prefill.ideal is None and "unsupported" in prefill.rejected[0].reason


def test_a_vision_encoder_gets_vllms_vit_list_and_no_route():
    gemma3 = dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                  torch_dtype="bfloat16",
                  text_config=dict(model_type="gemma3_text", hidden_size=640,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                   num_hidden_layers=2, intermediate_size=2048,
                                   vocab_size=1000),
                  vision_config=dict(model_type="siglip_vision_model", hidden_size=1152,
                                     num_attention_heads=16))
    out = _explain("h100", gemma3)
    assert out.not_loadable is None                 # the text decoder loads
    vit = next(r for r in out.routes if r.op == "vit_attention")
    assert (vit.ideal, vit.backend) == ("FLASH_ATTN", "")
    assert "no vision encoder runs" in vit.rejected[-1].reason
    # Head 72 on a T4: FlashAttention needs SM80, and below SM80 SDPA comes before Triton.
    vit = next(r for r in _explain("t4", gemma3, dtype="float16").routes
               if r.op == "vit_attention")
    assert vit.ideal == "TORCH_SDPA"


def test_flags_add_to_the_config_and_never_hide_it():
    facts = _facts("gpt_oss")
    assert SelectionInputs().for_model(facts).has_sinks
    assert SelectionInputs(attn_type="encoder").for_model(facts).attn_type == "encoder"


def _checkpoint_with(tiny_checkpoint, tmp_path, **config_fields) -> str:
    path = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint("llama"), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(config_fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_the_engine_refuses_what_its_kernels_cannot_run(tiny_checkpoint, tmp_path, monkeypatch):
    from archserve.engine.llm import LLM

    path = _checkpoint_with(tiny_checkpoint, tmp_path, is_causal=False)
    with pytest.raises(ValueError, match="encoder_only attention is not implemented"):
        LLM(path, dtype="float32")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="batch-invariant mode is not implemented"):
        LLM(tiny_checkpoint("llama"), dtype="float32")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with pytest.raises(ValueError, match="int8_per_token_head KV cache"):
        LLM(tiny_checkpoint("llama"), dtype="float32", kv_cache_dtype="int8_per_token_head")


def test_matrix_rows_for_sinks_vit_and_mla_prefill():
    from archserve.platform.profiles import all_profiles
    from archserve.routing.matrix import build_matrix

    rows = {f["name"]: f for f in build_matrix(all_profiles())["features"]}
    sinks = rows["Sinks: FlashAttention"]["support"]
    assert sinks["h100"] and sinks["b200"] and not sinks["a100"]
    assert rows["Sinks: Triton Attn"]["support"]["a100"]
    vit = rows["ViT attention (vLLM's ViT list)"]
    assert (vit["notes"]["t4"], vit["notes"]["h100"]) == ("SDPA", "FA")
    prefill = rows["MLA prefill (vLLM's prefill list)"]
    assert prefill["support"]["b200"] and not prefill["support"]["cpu"]
    assert not vit["implemented"] and not prefill["implemented"]
