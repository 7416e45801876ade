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

from models.helpers import (
    PROMPTS,
    TEXT_PROMPTS,
    PagedSequences,
    assert_chunked_prefix_and_preemption_equal_hf,
    assert_dummy_weights_run,
    assert_greedy_agrees_with_hf,
    assert_llm_greedy_and_prompt_logprobs_equal_hf,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    bf16_greedy_params,
    bf16_logprob_drift,
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
    assert_dummy_weights_run(pair[0], tmp_path)


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_ckpt")), "gpt_oss",
                                 **GPT_OSS)


def test_llm_greedy_and_prompt_logprobs_equal_transformers(checkpoint):
    assert_llm_greedy_and_prompt_logprobs_equal_hf(checkpoint, TEXT_PROMPTS, 32)


def test_llm_chunked_prefill_prefix_cache_and_preemption(checkpoint, monkeypatch):
    """Prefills chunked 8 tokens a step (each chunk's window reaching back into cached
    blocks), prompts sharing a cached prefix, and preemption."""
    assert_chunked_prefix_and_preemption_equal_hf(checkpoint, monkeypatch)


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


def test_mxfp4_dummy_weights_are_small_and_the_step_reads_the_packed_bytes():
    """The benchmark's MXFP4 shapes load this way: random e2m1 bytes and small e8m0 scales
    (weights of the dense ones' size: finite logits); a decode step reads each touched
    expert's packed bytes (blocks, scales, biases), not bf16's."""
    from archserve.engine.step_weights import step_weights
    from archserve.kernels.linear.quantized_weights import dequantize_mxfp4
    from archserve.loader.loader import load_model
    model, config = load_model(MXFP4_FIXTURE, dtype=torch.bfloat16, load_format="dummy")
    for moe in model.moe_layers():
        assert dequantize_mxfp4(moe.quantized.w13).abs().max() < 0.01
    logits = PagedSequences.for_config(config, dtype=torch.bfloat16).run(model, {0: PROMPTS[0]})
    assert torch.isfinite(logits).all()
    weights = step_weights(model, config)
    e, h, i = 4, 128, 64
    per_layer = e * (2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32) \
        + e * (2 * i + h) * 2
    assert weights.expert_bytes == 2 * per_layer


def test_mxfp4_llm_equals_transformers_dequantizing_the_same_files():
    """The engine on the MXFP4 files against transformers reading them with its own MXFP4
    decoder (``Mxfp4Config(dequantize=True)``), fp32: the same greedy tokens (32, past the
    16-token window) and prompt log-probabilities within 1e-4."""
    assert_llm_greedy_and_prompt_logprobs_equal_hf(MXFP4_FIXTURE, TEXT_PROMPTS, 32,
                                                   hf_kwargs=_mxfp4_hf())


def test_mxfp4_chunked_prefill_prefix_cache_and_preemption(monkeypatch):
    assert_chunked_prefix_and_preemption_equal_hf(MXFP4_FIXTURE, monkeypatch,
                                                  hf_kwargs=_mxfp4_hf())


# ---------------------------------------------------------------- GPU

def _checkpoint_of(form: str, tmp_path) -> tuple[str, dict]:
    """(path, transformers' from_pretrained arguments) of the tiny bf16-form checkpoint or
    the MXFP4 fixture."""
    if form == "mxfp4":
        return MXFP4_FIXTURE, _mxfp4_hf()
    return build_tiny_checkpoint(str(tmp_path), "gpt_oss", **GPT_OSS), {}


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("form", ["bf16 checkpoint", "mxfp4"])
def test_gpu_llm_greedy_equals_transformers(tmp_path, form, enforce_eager):
    """fp32 on the GPU: Triton attention with sinks over the 4- or 16-token windows, the
    Triton MoE (16-bit, or MXFP4 decoded in registers) with the clamped SwiGLU and biases,
    decode in CUDA graphs unless eager; greedy tokens are transformers' (fp32, on the CPU;
    for MXFP4 its own decoder's dequantized weights), up to a near-tie."""
    from transformers import AutoModelForCausalLM

    from archserve import LLM, SamplingParams
    path, hf_kwargs = _checkpoint_of(form, tmp_path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    **hf_kwargs).eval()
    llm = LLM(path, dtype="float32", device="cuda", enforce_eager=enforce_eager,
              gpu_memory_utilization=0.3)
    engine = llm.llm_engine
    routes = {r.layer: r.backend for r in engine.report.routes}
    assert routes["attention"] == "TRITON_ATTN" and routes["moe experts"] == "TRITON_FUSED_MOE"
    assert bool(engine.report.graph_sizes) != enforce_eager, engine.report.graphs_off
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for out in llm.generate(TEXT_PROMPTS, params):
        assert_greedy_agrees_with_hf(hf_model, out.prompt_token_ids, list(out.outputs[0].token_ids), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["bf16 checkpoint", "mxfp4"])
def test_gpu_bf16_engine_is_within_transformers_bf16_drift(tmp_path, form):
    """bf16 on the GPU, graphs on, against transformers in fp32 (MXFP4: its dequantized
    experts): the log-probs of the prompt and generated tokens drift from it no more than
    transformers' own bf16 run does (twice its mean). Not a position-wise bound against
    transformers' bf16: with 4 experts, top 2, some tokens' second and third router logits
    are 0.01 apart, and either bf16 run may swap them (the MXFP4 fixture's first prompt
    does on a CPU too, moving one log-prob by 0.35: mean drifts 0.022 against 0.021)."""
    from archserve import LLM
    path, hf_kwargs = _checkpoint_of(form, tmp_path)
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    outputs = llm.generate(TEXT_PROMPTS, bf16_greedy_params())
    del llm
    ours, theirs = bf16_logprob_drift(path, outputs, **hf_kwargs)
    print(f"mean |delta logprob| against fp32: archserve bf16 {ours:.4f}, transformers bf16 "
          f"{theirs:.4f}")
    assert ours <= max(2 * theirs, 0.02), (ours, theirs)
