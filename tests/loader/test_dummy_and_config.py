"""Dummy weights and config normalisation."""

from __future__ import annotations

import torch
from models.helpers import PagedSequences, tiny_hf_model

from archserve.loader.loader import load_model
from archserve.models.config import ModelConfig


def test_dummy_weights_have_real_shapes_and_dtype(tmp_path):
    tiny_hf_model("qwen2", tie_word_embeddings=False).save_pretrained(tmp_path)
    model, config = load_model(str(tmp_path), torch.bfloat16, load_format="dummy")
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((4 + 2 + 2) * 16, 64)
    assert 0 < qkv.float().abs().max() <= 1e-3
    assert torch.all(params["model.norm.weight"] == 1)
    logits = PagedSequences.for_config(config, dtype=torch.bfloat16).run(model, {0: [1, 2, 3]})
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_qwen2_has_qkv_bias_but_no_o_bias_and_eos_from_generation_config(tmp_path):
    hf = tiny_hf_model("qwen2", tie_word_embeddings=False)
    hf.generation_config.eos_token_id = [7, 9]
    hf.save_pretrained(tmp_path)
    from archserve.loader.config import load_hf_model_config
    config = load_hf_model_config(str(tmp_path))
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm
    assert config.eos_token_ids == [7, 9]
    assert config.architecture == "Qwen2ForCausalLM"


def test_rope_and_sliding_window_normalisation():
    from transformers import LlamaConfig, MistralConfig

    llama = ModelConfig.from_hf_config(LlamaConfig(
        num_hidden_layers=2, rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192,
                                              "rope_theta": 500000.0}))
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.layer_sliding_windows == [None, None]
    mistral = ModelConfig.from_hf_config(MistralConfig(num_hidden_layers=3, sliding_window=4096))
    assert mistral.rope_scaling is None and mistral.layer_sliding_windows == [4096] * 3
