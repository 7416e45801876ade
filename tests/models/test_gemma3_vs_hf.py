"""Gemma 3 against transformers with the same (tiny, random) weights, fp32, CPU.

Prompts are longer than the sliding window (8), so the sliding layers really drop keys the
full-attention layers keep; the local and global RoPE bases differ, so a layer given the
wrong one shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from archserve import LLM, SamplingParams
from archserve.loader.loader import load_model
from models.helpers import (
    PagedSequences,
    assert_dummy_weights_run,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    hf_last_logits,
    saved_and_loaded,
    tiny_hf_model,
)

WINDOW = 8
GEMMA3 = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, intermediate_size=192,
              sliding_window=WINDOW, query_pre_attn_scalar=48,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}})

VARIANTS = {
    "head64_tied": dict(tie_word_embeddings=True),
    # head_dim 256 as in the real models, neither hidden/heads nor query_pre_attn_scalar.
    "head256_linear_rope": dict(head_dim=256, num_key_value_heads=1, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    # Gemma 2's soft caps, which Gemma 3 configs may still set: transformers applies the
    # final one and ignores the attention one (Gemma 3 has q/k norms instead).
    "softcaps_untied": dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                            tie_word_embeddings=False),
}

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 7],
           [200, 1, 2],
           [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44]]
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf_model = tiny_hf_model("gemma3_text", **{**GEMMA3, **VARIANTS[request.param]})
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp(request.param))


def test_config_facts(pair):
    hf_model, _, config = pair
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.layer_sliding_windows == [WINDOW, WINDOW, None, WINDOW]
    assert config.layer_rope(0)[0] == 100.0 and config.layer_rope(2)[0] == 10000.0
    assert config.attention_scale == 48 ** -0.5
    assert config.hidden_activation == "gelu_pytorch_tanh" and config.qk_norm
    assert config.final_logit_soft_cap == hf_model.config.final_logit_softcapping


def test_transformers4_style_config_is_normalised():
    """config.json files written by transformers 4 name the bases rope_theta and
    rope_local_base_freq and the global scaling rope_scaling (Gemma-3-4B and larger)."""
    from transformers import Gemma3TextConfig

    from archserve.models.config import ModelConfig

    config = ModelConfig.from_hf_config(Gemma3TextConfig(
        num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert config.layer_sliding_windows[4] == 4096 and config.layer_sliding_windows[5] is None
    assert config.layer_rope(0) == (1e4, None)
    assert config.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert config.attention_scale == 256 ** -0.5


def test_dummy_weights_leave_gemma_norms_the_identity(tmp_path):
    model = assert_dummy_weights_run(tiny_hf_model("gemma3_text", **GEMMA3), tmp_path,
                                     PROMPTS[0])
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 4 * 6 + 1 and all(torch.all(p == 0) for p in norms)


def test_batched_prefill_then_decode_matches_hf(pair):
    hf_model, model, config = pair
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS, ATOL)


def test_all_positions_of_a_prompt_match_hf(pair):
    hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0], ATOL)


def test_window_and_rope_bases_matter(pair):
    """The comparison above can fail: without the window, or with one RoPE base for
    every layer, the logits of a prompt longer than the window move."""
    hf_model, model, config = pair
    expected = hf_last_logits(hf_model, PROMPTS[0])
    attns = [layer.self_attn.attn for layer in model.model.layers]
    windowed = [attn.params for attn in attns]
    for attn in attns:
        attn.params = dataclasses.replace(attn.params, sliding_window=None)
    try:
        unwindowed = PagedSequences.for_config(config).run(model, {0: PROMPTS[0]})[0]
    finally:
        for attn, params in zip(attns, windowed, strict=True):
            attn.params = params
    assert (unwindowed - expected).abs().max() > 1e-3
    rotaries = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert rotaries[0] is rotaries[1] is rotaries[3] and rotaries[0] is not rotaries[2]
    assert not torch.equal(rotaries[0].cos_cache, rotaries[2].cos_cache)


def test_multimodal_checkpoint_loads_its_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration config.json + checkpoint: the decoder is read from
    text_config and language_model.* weights; the vision tower is skipped."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = {**GEMMA3, "vocab_size": 256, "max_position_embeddings": 64}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=252, eoi_token_index=253, image_token_index=254)
    config.text_config._attn_implementation = "eager"
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_model.save_pretrained(tmp_path)
    model, ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert ours.architecture == "Gemma3ForConditionalGeneration"
    assert ours.model_type == "gemma3_text" and ours.layer_sliding_windows[2] is None
    logits = PagedSequences.for_config(ours).run(model, {0: PROMPTS[0]})[0]
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the engine, greedy

TEXT_PROMPTS = ["Hello world! The capital of France is Paris. The capital of Italy",
                "A paged KV cache stores keys and values in fixed-size blocks.",
                "1 2 3 4 5 6 7 8 9 10 11 12"]


def hf_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens with a full forward per step: no cache, the masks alone decide."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_llm_greedy_equals_transformers(tmp_path, head_dim):
    from transformers import AutoModelForCausalLM

    # Untied: a tied random model mostly repeats its last token, which would make
    # agreement cheap; an untied one wanders over the vocabulary.
    overrides = {**GEMMA3, "head_dim": head_dim, "tie_word_embeddings": False}
    path = build_tiny_checkpoint(str(tmp_path), "gemma3_text", **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(TEXT_PROMPTS, params)
    for output in outputs:
        assert len(output.prompt_token_ids) + 16 > WINDOW
        expected = hf_greedy(hf_model, output.prompt_token_ids, 16)
        assert list(output.outputs[0].token_ids) == expected, output.prompt
        assert len(set(expected)) > 4  # the check above compares real sequences


def assert_greedy_agrees(hf_model, prompt_ids: list[int], ours: list[int], device: str,
                         near_tie: float = 1e-4) -> None:
    """Our greedy tokens are transformers' argmax at every step, up to a near-tie: GPU
    kernels sum in other orders than the CPU, so where transformers' top two logits are
    within ``near_tie`` either choice is right, and the continuations part there."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for step, token in enumerate(ours):
            logits = hf_model(torch.tensor([ids], device=device), logits_to_keep=1).logits
            logits = logits[0, -1].float()
            best = int(logits.argmax())
            if token != best:
                margin = float(logits[best] - logits[token])
                assert margin < near_tie, (f"step {step}: ours {token}, transformers {best}, "
                                           f"{margin:.3g} apart")
                return
            ids.append(token)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gpu_llm_greedy_equals_transformers(tmp_path, head_dim):
    """On a GPU the engine runs Triton attention (sliding windows, head 256), the fused
    norm / GeGLU / rotary kernels and CUDA graphs; in fp32 it must still give
    transformers' greedy tokens (transformers on the CPU)."""
    from transformers import AutoModelForCausalLM

    overrides = {**GEMMA3, "head_dim": head_dim, "tie_word_embeddings": False}
    path = build_tiny_checkpoint(str(tmp_path), "gemma3_text", **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    llm = LLM(path, dtype="float32", device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for output in llm.generate(TEXT_PROMPTS, params):
        assert_greedy_agrees(hf_model, output.prompt_token_ids,
                             list(output.outputs[0].token_ids), "cpu")


@pytest.mark.gpu
def test_gpu_real_shape_greedy_equals_transformers(tmp_path):
    """Gemma-3-270M's shapes (hidden 640, 4 heads on 1 KV head of 256, window 512, vocab
    262144; six layers, the sixth global), random weights, a prompt longer than the
    window: the engine on the GPU against transformers on the GPU, both fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        sliding_window=512, max_position_embeddings=2048, tie_word_embeddings=False)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_model.save_pretrained(tmp_path)
    hf_model = hf_model.cuda().eval()
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_model_len=2048,
              skip_tokenizer_init=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 262144, (n,), generator=gen).tolist() for n in (700, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        assert_greedy_agrees(hf_model, prompt, list(output.outputs[0].token_ids), "cuda")
