"""DeepSeek-V3.2 and GLM-5 (DSA: the lightning indexer and top-k sparse MLA) against
transformers with the same tiny random weights, fp32, CPU: every prompt position, batched
prefill then decode through the paged cache (the indexer key beside the latent), the whole
engine's greedy tokens (32) and prompt log-probs, chunked prefill over a cached prefix with
preemption, a block-FP8 checkpoint, dummy weights and the fp8 caches' cost.

Sizes are odd (hidden 72, latent 40 + rope 8, indexer keys of 24, 9 indexer heads: with 2-3
many keys score exactly 0 after the ReLU and top-k ties break arbitrarily). index_topk is
smaller than the prompts (the sparse path is taken from the 5th token on) or larger than
every context (exactly dense MLA). GLM-5's variant has a "shared" layer (it reuses the
previous layer's selection) and rotates the indexer's interleaved rope pairs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from archserve.engine.config import EngineConfig
from archserve.engine.startup import attention_spec_of
from archserve.kernels.catalog import select_attention_backend
from archserve.models.layers.mla import MLAAttention
from archserve.platform import get_profile
from models.helpers import (
    PROMPTS,
    TEXT_PROMPTS,
    PagedSequences,
    assert_chunked_prefix_and_preemption_equal_hf,
    assert_dummy_weights_run,
    assert_gpu_chunked_prefix_tracks_one_prefill,
    assert_llm_greedy_and_prompt_logprobs_equal_hf,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    bf16_greedy_params,
    bf16_logprob_drift,
    hf_last_logits,
    prompt_logprob_gaps,
    tiny_hf_model,
    variant_pair,
    without_activation_quantization,
)

ATOL = 1e-4
DSA = dict(hidden_size=72, intermediate_size=88, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=40, q_lora_rank=56, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=12,
           v_head_dim=20, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, n_group=4,
           topk_group=2, routed_scaling_factor=2.5, index_n_heads=9, index_head_dim=24,
           max_position_embeddings=256, tie_word_embeddings=False)


def _yarn() -> dict:
    return dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                mscale_all_dim=1.0, beta_fast=32, beta_slow=1, rope_theta=10000.0)


VARIANTS = {
    # V3.2: sigmoid routing within groups, YaRN, the indexer's rope as two halves; top-4.
    "v32": ("deepseek_v32", dict(index_topk=4, rope_parameters=_yarn())),
    # Top-64, past every context here: the layers are exactly dense MLA.
    "v32_dense": ("deepseek_v32", dict(index_topk=64)),
    # GLM-5: one routing group, the indexer's interleaved rope, a shared second layer; top-5.
    "glm": ("glm_moe_dsa", dict(index_topk=5, n_group=1, topk_group=1,
                                indexer_types=["full", "shared", "full"])),
}
RANDOM_BUFFERS = ("e_score_correction_bias",)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    return variant_pair(VARIANTS, request.param, DSA, tmp_path_factory.mktemp(request.param),
                        random_buffers=RANDOM_BUFFERS)


def test_indexers_and_cache_rows_follow_the_config(pair):
    name, _, model, config = pair
    sparse = config.sparse_attention
    assert (sparse.index_n_heads, sparse.index_head_dim) == (9, 24)
    attention = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a, MLAAttention) and a.index_topk == sparse.index_topk
               for a in attention)
    shared = name == "glm"
    assert [a.indexer is not None for a in attention] == [True, not shared, True]
    assert sparse.indexer_rope_interleaved == shared
    # The latent (40 + 8) and the indexer key (24) in one fp32 row a token.
    spec = attention_spec_of(EngineConfig(model="x"), config, torch.float32, "auto")
    assert spec.use_mla and spec.mla_sparse and spec.head_size == 48
    cache = PagedSequences.for_config(config).kv_caches[0]
    assert cache.shape[-1] == 48 + 24 and cache.dtype == torch.float32


def test_prompt_positions_and_prefill_then_decode_match_hf(pair):
    """Every position of a 15-token prompt (top-k from the 5th), then a batched prefill and
    a decode step of each sequence through the paged cache."""
    _, hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0] + PROMPTS[2], ATOL)
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS, ATOL)


def test_the_comparison_can_fail(pair):
    """The selection matters: attending to every key moves a sparse model's logits."""
    name, hf_model, model, config = pair
    if name == "v32_dense":
        pytest.skip("dense already")
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    for layer in layers:
        layer.index_topk = 1000
    try:
        changed = PagedSequences.for_config(config).run(model, {0: PROMPTS[0]})[0]
    finally:
        for layer in layers:
            layer.index_topk = config.sparse_attention.index_topk
    assert (changed - hf_last_logits(hf_model, PROMPTS[0])).abs().max() > 1e-3


def test_cpu_selects_the_torch_route(pair):
    _, _, _, config = pair
    spec = attention_spec_of(EngineConfig(model="x"), config, torch.float32, "auto")
    selection = select_attention_backend(get_profile("cpu"), spec)
    assert selection.name == "TORCH_REFERENCE" and selection.backend.op == "mla_attention"


@pytest.mark.parametrize("caches", [("fp8_ds_mla", "bfloat16"), ("auto", "fp8")],
                         ids=["fp8_ds_mla", "fp8-indexer"])
def test_fp8_caches_cost(pair, caches):
    """What the fp8 formats cost, against the exact 16-bit rows, over a prefill and a decode
    step: fp8_ds_mla latents (e4m3, a scale per 128 values) and fp8 indexer keys (e4m3, a
    power-of-two scale per 128). Measured on these random 3-layer models (logits' std 0.47):
    fp8_ds_mla moves the last tokens' logits by up to 0.66 (KL up to 0.022), as the per-
    tensor fp8 latent of dense MLA does (0.29, KL 0.006, on the same sizes); fp8 indexer
    keys change nothing until a key near the top-k's edge swaps (0.76, KL 0.027, once)."""
    name, _, model, config = pair
    if name == "v32_dense":
        pytest.skip("the sparse variants cover the formats")
    kv, index = caches
    exact = PagedSequences.for_config(config)
    fp8 = PagedSequences.for_config(config, kv_cache_dtype=kv, index_cache_dtype=index)
    for step in (dict(enumerate(PROMPTS)), {0: [7], 1: [8], 2: [9]}):
        want, got = exact.run(model, step), fp8.run(model, step)
        assert (got - want).abs().max() < 1.0
        p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        assert (p.exp() * (p - q)).sum(-1).max() < 0.05
        if kv == "fp8_ds_mla":
            assert (got - want).abs().max() > 0     # the latent really went through fp8


def test_dummy_weights_run(tmp_path):
    model_type, overrides = VARIANTS["glm"]
    model = assert_dummy_weights_run(
        tiny_hf_model(model_type, **{**DSA, **overrides, "vocab_size": 256}), tmp_path)
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32     # as transformers keeps it


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llm_greedy_and_prompt_logprobs_equal_transformers(tmp_path, variant):
    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, random_buffers=RANDOM_BUFFERS,
                                 **{**DSA, **overrides})
    assert_llm_greedy_and_prompt_logprobs_equal_hf(path, TEXT_PROMPTS, 32)


@pytest.mark.parametrize("variant", ["v32", "glm"])
def test_llm_chunked_prefill_prefix_cache_and_preemption(tmp_path, monkeypatch, variant):
    """The indexer keys beside the latents through the engine's harder paths: a cached
    prefix (its blocks carry both), prefills chunked 8 tokens a step (each chunk's rows
    select among the prefix's keys), and preemption."""
    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, random_buffers=RANDOM_BUFFERS,
                                 **{**DSA, **overrides})
    assert_chunked_prefix_and_preemption_equal_hf(path, monkeypatch)


def test_block_fp8_checkpoint_matches_its_dequantized_weights(tmp_path):
    """DeepSeek-V3.2's release layout: every projection (MLA, the indexer's wq_b and wk, the
    experts) block-FP8 with fp32 weight_scale_inv per 128 x 128; weights_proj, the norms and
    the router stay 16-bit. With the activations' quantization off, archserve's logits are
    transformers' over the dequantized weights (its fp8 loader cannot dequantize the partial
    blocks of these sizes, as it cannot for the real V3's kv_a_proj)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from archserve import LLM

    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "quant_fixtures")
    sys.path.insert(0, scripts)
    try:
        import fp8_block_hf
    finally:
        sys.path.remove(scripts)
    model_type, overrides = VARIANTS["v32"]
    # Block-FP8 activations are quantized per 128 input channels: every GEMM's input width
    # a multiple of 128 (output widths stay odd: partial row blocks).
    widths = dict(hidden_size=128, intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
                  v_head_dim=32, moe_intermediate_size=128)
    base = build_tiny_checkpoint(str(tmp_path / "base"), model_type,
                                 random_buffers=RANDOM_BUFFERS,
                                 **{**DSA, **overrides, **widths})
    linears = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
               "gate_proj", "up_proj", "down_proj", "wq_b", "wk")
    fp8 = fp8_block_hf.write(base, str(tmp_path / "fp8"), linears=linears)
    state = load_file(os.path.join(fp8, "model.safetensors"))
    assert state["model.layers.1.self_attn.indexer.wk.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16
    dense = {name: (t.float() if name + "_scale_inv" not in state else
                    fp8_block_hf.dequantize_block(t, state[name + "_scale_inv"], 128, 128))
             for name, t in state.items() if not name.endswith("_scale_inv")}
    save_file(dense, os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
    hf_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    llm = LLM(fp8, dtype="float32", max_model_len=128)
    model = llm.llm_engine.model
    assert model.model.layers[1].self_attn.indexer.wq_b.quant is not None
    without_activation_quantization(model)
    gaps = prompt_logprob_gaps(hf_model, llm, [{"prompt_token_ids": list(range(5, 45))}])
    assert max(gaps) < ATOL


# ---------------------------------------------------------------- GPU

# Latent 256 + 64 and q/k heads of 128 + 64, values of 128 (the Triton prefill's sizes for
# the steps within top-k), indexer keys of 128 (64 of them rotated) with 16 heads.
GPU_DSA = dict(DSA, hidden_size=256, intermediate_size=256, kv_lora_rank=256, q_lora_rank=128,
               qk_rope_head_dim=64, head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               moe_intermediate_size=64, index_n_heads=16, index_head_dim=128,
               max_position_embeddings=1024)
GPU_ENGINE = dict(kv_cache_memory_bytes=1 << 28, max_num_seqs=8, self_check=False)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("variant", ["v32", "glm"])
def test_gpu_bf16_engine_is_within_transformers_bf16_drift(tmp_path, variant, enforce_eager):
    """The engine on the GPU in bf16 (TRITON_MLA_SPARSE: the Triton indexer, top-k and
    indexed MLA kernels; decode in CUDA graphs unless eager, async scheduling) against
    transformers in fp32: the log-probs of the prompt and generated tokens drift from it
    no more than transformers' own bf16 run does (twice its mean, as the near-ties that
    bf16 rounding swaps, of experts and of keys at the top-k's edge, fall elsewhere)."""
    from archserve import LLM

    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, random_buffers=RANDOM_BUFFERS,
                                 **{**GPU_DSA, **overrides})
    llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=enforce_eager,
              **GPU_ENGINE)
    engine = llm.llm_engine
    routes = {r.layer: r for r in engine.report.routes}
    assert (routes["attention"].op, routes["attention"].backend) == \
        ("mla_attention", "TRITON_MLA_SPARSE")
    assert bool(engine.report.graph_sizes) != enforce_eager, engine.report.graphs_off
    assert engine.report.canary and all("passed" in c for c in engine.report.canary), \
        engine.report.canary
    assert any(d.what == "scheduling" and d.chosen == "async" for d in engine.report.decisions)
    outputs = llm.generate(TEXT_PROMPTS, bf16_greedy_params())
    del llm, engine
    ours, theirs = bf16_logprob_drift(path, outputs)
    print(f"mean |delta logprob| against fp32: archserve bf16 {ours:.4f}, transformers bf16 "
          f"{theirs:.4f}")
    assert ours <= max(2 * theirs, 0.02), (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "auto+fp8-indexer"])
def test_gpu_fp8_caches_run_in_graphs(tmp_path, kv):
    """fp8_ds_mla latents with fp8 indexer keys (--kv-cache-dtype fp8), and fp8 indexer keys
    beside a bf16 latent: the engine starts (canary, graphs) and its log-probs stay within
    the fp8 rows' cost of transformers' fp32 ones. That cost at these sizes (top-16), from
    the torch path in fp32 over a 40-token prompt: mean |delta logprob| 0.12 (fp8_ds_mla and
    fp8 keys) and 0.11 (fp8 keys alone); the bound leaves bf16's drift beside it."""
    from archserve import LLM

    model_type, overrides = VARIANTS["v32"]
    path = build_tiny_checkpoint(str(tmp_path), model_type, random_buffers=RANDOM_BUFFERS,
                                 **{**GPU_DSA, **overrides, "index_topk": 16})
    caches = (dict(kv_cache_dtype="fp8") if kv == "fp8"
              else dict(index_cache_dtype="fp8"))
    llm = LLM(path, dtype="bfloat16", device="cuda", **caches, **GPU_ENGINE)
    engine = llm.llm_engine
    assert engine.report.graph_sizes and all("passed" in c for c in engine.report.canary)
    layout = engine.runner.attn_impl.layout
    assert layout.index_fp8 and layout.latent_fp8 == (kv == "fp8")
    outputs = llm.generate(TEXT_PROMPTS, bf16_greedy_params())
    del llm, engine
    ours, _ = bf16_logprob_drift(path, outputs)
    assert ours < 0.3, ours


@pytest.mark.gpu
def test_gpu_chunked_prefill_over_a_cached_prefix_matches_one_prefill(tmp_path):
    """GLM-5 (a shared layer): chunks past top-k over a cached prefix, beside decodes."""
    model_type, overrides = VARIANTS["glm"]
    path = build_tiny_checkpoint(str(tmp_path), model_type, random_buffers=RANDOM_BUFFERS,
                                 **{**GPU_DSA, **overrides})
    assert_gpu_chunked_prefix_tracks_one_prefill(path, GPU_ENGINE)
