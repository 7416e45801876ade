"""Our decoder against transformers with the same (tiny, random) weights, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from models.helpers import (
    PROMPTS,
    PagedSequences,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    hf_last_logits,
    saved_and_loaded,
    tiny_hf_model,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10000.0}

VARIANTS = {
    "llama3_scaled_tied": ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama_linear_rope_biases": ("llama", dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen2_qkv_bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3_qk_norm_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "mistral_sliding_window": ("mistral", dict(sliding_window=5, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    model_type, overrides = VARIANTS[request.param]
    hf_model = tiny_hf_model(model_type, **overrides)
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp(request.param))


def test_single_prefill_matches_hf(pair):
    hf_model, model, config = pair
    cache = PagedSequences.for_config(config)
    ours = cache.run(model, {0: PROMPTS[0]})[0]
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def test_batched_prefill_then_decode_matches_hf(pair):
    hf_model, model, config = pair
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS)


def test_all_positions_of_a_prompt_match_hf(pair):
    hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0])
