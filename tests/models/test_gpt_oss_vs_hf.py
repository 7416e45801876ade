"""gpt-oss against transformers with the same (tiny, random) weights, fp32, CPU: every
logit of a prompt, batched prefill then decode, and the whole engine's greedy tokens (32)
and prompt log-probabilities, through sliding-window layers shorter than the prompts,
chunked prefill and preemption.

What gpt-oss adds to an MoE decoder, and what each test would catch if it went wrong:
attention sinks (``test_the_comparison_can_fail``), the clamped SwiGLU with its alpha and
limit, biases after every projection and in the router, gate and up interleaved in the
stacked checkpoint, YaRN without truncation, alternating sliding and full layers.
"""

from __future__ import annotations

import os

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from archserve.engine.scheduler import Scheduler
from models.helpers import (
    PROMPTS,
    TEXT_PROMPTS,
    PagedSequences,
    assert_llm_greedy_and_prompt_logprobs_equal_hf,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    hf_last_logits,
    saved_and_loaded,
    tiny_hf_model,
)

ATOL = 1e-4
# Heads of 32 (the Triton attention's floor, so the GPU test runs it); a window of 4, far
# shorter than the prompts; YaRN scaling 8 from an original 32 positions, untruncated; a
# SwiGLU limit these weights reach (about 14% of the gates and 25% of the ups are clamped)
# and an alpha of its own (the config's, not the released 1.702).
GPT_OSS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=4, tie_word_embeddings=False, max_position_embeddings=256,
               swiglu_limit=0.5, swiglu_alpha=1.5,
               rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 32,
                                "rope_theta": 150000.0})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf_model = tiny_hf_model("gpt_oss", **GPT_OSS)
    # Sinks of the scores' own scale, so they take a share of every row.
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp("gpt_oss"))


def test_layers_follow_the_config(pair):
    hf_model, model, config = pair
    windows = [layer.self_attn.attn.params.sliding_window for layer in model.model.layers]
    assert windows == [4, None] and config.layer_sliding_windows == [4, None]
    assert all(layer.self_attn.attn.sinks is not None for layer in model.model.layers)
    for moe in model.moe_layers():
        assert moe.activation.kind == "swigluoai"
        assert (moe.activation.alpha, moe.activation.limit) == (1.5, 0.5)
        assert moe.w13_bias is not None and moe.backend_name in ("", "TORCH_MOE")


def test_all_positions_of_a_prompt_match_hf(pair):
    hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0], ATOL)


def test_batched_prefill_then_decode_matches_hf(pair):
    hf_model, model, config = pair
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS, ATOL)


@pytest.mark.parametrize("what", ["sinks", "expert biases", "swiglu limit"])
def test_the_comparison_can_fail(pair, what):
    """Each of gpt-oss's additions matters to the logits: without it they move."""
    hf_model, model, config = pair
    layer = model.model.layers[0]
    moe = model.moe_layers()[0]
    if what == "sinks":
        saved = layer.self_attn.attn.sinks.clone()
        target = layer.self_attn.attn.sinks
    elif what == "expert biases":
        saved, target = moe.w13_bias.clone(), moe.w13_bias
    else:
        saved_activation = moe.activation
        import dataclasses
        moe.activation = dataclasses.replace(moe.activation, limit=5.0)
    try:
        if what != "swiglu limit":
            with torch.no_grad():
                target.zero_()
        changed = PagedSequences.for_config(config).run(model, {0: PROMPTS[0]})[0]
    finally:
        if what == "swiglu limit":
            moe.activation = saved_activation
        else:
            with torch.no_grad():
                target.copy_(saved)
    assert (changed - hf_last_logits(hf_model, PROMPTS[0])).abs().max() > 1e-3


def test_dummy_weights_run(pair, tmp_path):
    hf_model, _, _ = pair
    hf_model.save_pretrained(tmp_path)
    from archserve.loader.loader import load_model
    model, config = load_model(str(tmp_path), torch.bfloat16, load_format="dummy")
    logits = PagedSequences.for_config(config, dtype=torch.bfloat16).run(model, {0: PROMPTS[0]})
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_ckpt")), "gpt_oss",
                                 **GPT_OSS)


def test_llm_greedy_and_prompt_logprobs_equal_transformers(checkpoint):
    assert_llm_greedy_and_prompt_logprobs_equal_hf(checkpoint, TEXT_PROMPTS, 32)


def test_llm_chunked_prefill_prefix_cache_and_preemption(checkpoint, monkeypatch):
    """Prompts sharing a cached prefix, prefills chunked 8 tokens a step (each chunk's
    window reaching back into cached blocks), and a pool too small for every sequence at
    once, so some are preempted and recomputed."""
    shared = "A paged KV cache stores keys and values in fixed-size blocks. "
    prompts = [shared + tail for tail in ("The capital of", "1 2 3", "Hello world")]
    preempted = []
    original = Scheduler._preempt

    def counting(self, seq, *args):
        preempted.append(seq.seq_id)
        return original(self, seq, *args)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    outputs = assert_llm_greedy_and_prompt_logprobs_equal_hf(
        checkpoint, prompts, 32, prompt_logprobs=False, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4, num_kv_blocks=24,
        max_model_len=80)
    assert preempted, "the pool was large enough for every sequence: nothing was preempted"
    assert max(out.num_cached_tokens for out in outputs) >= 8


# ---------------------------------------------------------------- MXFP4 (OpenAI's form)

MXFP4_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant",
                             "gpt-oss-mxfp4")


def _mxfp4_hf():
    from transformers import Mxfp4Config
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def test_mxfp4_checkpoint_keeps_its_experts_packed():
    """scripts/quant_fixtures/gpt_oss_mxfp4.py's checkpoint: the experts load as MXFP4
    (uint8 blocks and e8m0 scales, gate and up rows apart), every other layer 16-bit; on a
    CPU the torch loop runs them, dequantized once."""
    from archserve.kernels.linear.quantized_weights import Mxfp4Weight
    from archserve.loader.loader import load_model
    model, config = load_model(MXFP4_FIXTURE, dtype=torch.float32)
    assert config.quantization_config["quant_method"] == "mxfp4"
    for moe in model.moe_layers():
        assert isinstance(moe.quantized.w13, Mxfp4Weight)
        assert moe.quantized.w13.blocks.shape == (4, 2 * 64, 128 // 2)
        assert moe.quantized.w2.scales.shape == (4, 128, 64 // 32)
        assert moe.impl() is not None and moe.backend_name == "TORCH_MOE"
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters()
               if "experts" not in n)


def test_mxfp4_llm_equals_transformers_dequantizing_the_same_files():
    """The engine on the MXFP4 files against transformers reading them with its own MXFP4
    decoder (``Mxfp4Config(dequantize=True)``), fp32: the same greedy tokens (32, past the
    16-token window) and prompt log-probabilities within 1e-4."""
    assert_llm_greedy_and_prompt_logprobs_equal_hf(MXFP4_FIXTURE, TEXT_PROMPTS, 32,
                                                   hf_kwargs=_mxfp4_hf())


def test_mxfp4_chunked_prefill_and_preemption():
    shared = "A paged KV cache stores keys and values in fixed-size blocks. "
    prompts = [shared + tail for tail in ("The capital of", "1 2 3", "Hello world")]
    assert_llm_greedy_and_prompt_logprobs_equal_hf(
        MXFP4_FIXTURE, prompts, 24, prompt_logprobs=False, hf_kwargs=_mxfp4_hf(),
        enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=4, num_kv_blocks=24,
        max_model_len=80)
