"""Tensor parallelism on CPU: two gloo ranks in worker processes against one rank in
the engine process, and what a lost worker does to the engine and the server loop."""

from __future__ import annotations

import os
import signal
import time

import pytest

from archserve import LLM
from archserve.bench.roofline import model_facts
from archserve.engine.sampling_params import SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is", "1 2 3 4 5"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, params: SamplingParams = GREEDY):
    return llm.generate(PROMPTS, params)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _two_ranks_match_one(path: str, max_tokens: int, logprob_tol: float,
                         max_model_len: int = 96) -> dict:
    """Greedy tokens of TP=2 equal TP=1's on PROMPTS, each token's logprob within
    ``logprob_tol``; returns the TP engine's start-up decisions by name."""
    common = dict(device="cpu", dtype="float32", max_model_len=max_model_len, max_num_seqs=4)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=1)
    one = LLM(path, **common).generate(PROMPTS, params)
    tp = LLM(path, tensor_parallel_size=2, **common)
    try:
        two = tp.generate(PROMPTS, params)
        decisions = {d.what: d for d in tp.llm_engine.report.decisions}
    finally:
        tp.llm_engine.shutdown()
    assert decisions["tensor parallel"].chosen.startswith("2 ranks")
    for a, b in zip(one, two, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for pos_one, pos_two, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                           a.outputs[0].token_ids, strict=True):
            assert pos_two[token].logprob == pytest.approx(pos_one[token].logprob,
                                                           abs=logprob_tol)
    return decisions


# llama: 4 query / 2 KV heads, each rank holds one KV head.
# qwen3-h64: 4 query / 1 KV head, q/k norms: the KV head is replicated on both ranks.
@pytest.mark.parametrize("variant", ["llama", "qwen3-h64"])
def test_two_ranks_generate_the_tokens_one_rank_does(tiny_checkpoint, variant):
    path = tiny_checkpoint(variant)
    common = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8)
    single = LLM(path, **common)
    one = _generate(single)
    tp = LLM(path, tensor_parallel_size=2, **common)
    try:
        two = _generate(tp)
        for a, b in zip(one, two, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert len(b.outputs[0].token_ids) == 32
        # Prompt logprobs come from rank 0's gathered logits, as close as one rank's.
        asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, logprobs=2)
        lp_one = single.generate(PROMPTS[0], asked)[0]
        lp_two = tp.generate(PROMPTS[0], asked)[0]
        assert len(lp_two.prompt_logprobs) == len(lp_two.prompt_token_ids)
        for row_one, row_two in zip(lp_one.prompt_logprobs[1:], lp_two.prompt_logprobs[1:],
                                    strict=True):
            assert row_one.keys() == row_two.keys()
            for token, entry in row_one.items():
                assert row_two[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
        decisions = {d.what: d for d in tp.llm_engine.report.decisions}
        assert decisions["tensor parallel"].chosen.startswith("2 ranks, gloo, mp")
        assert "rank 1:" in decisions["tensor parallel"].reason
    finally:
        tp.llm_engine.shutdown()


# Every expert's intermediate channels split over the ranks (each rank holds all experts),
# the shared expert as a dense MLP: Mixtral (w1/w2/w3 names, renormalised top-2), Qwen2-MoE
# (a shared expert behind its sigmoid gate, a dense layer among sparse ones), Qwen3-MoE
# (top-8 of 16 with q/k norms). Logprobs too: a tiny random MoE's greedy ids alone could
# hide a half-summed expert.
MOE_TP = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      decoder_sparse_step=2, num_hidden_layers=2),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=24,
                      norm_topk_prob=True, num_hidden_layers=2),
}


@pytest.mark.parametrize("model_type", list(MOE_TP))
def test_two_ranks_split_the_experts_and_generate_what_one_rank_does(tmp_path, model_type):
    from tiny_checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint(str(tmp_path), model_type, hidden_size=64,
                                 intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                 **MOE_TP[model_type])
    decisions = _two_ranks_match_one(path, max_tokens=16, logprob_tol=1e-4)
    assert "of each of the" in decisions["tensor parallel"].reason    # the experts' channels


# DeepSeek: MLA's heads split (query rows, kv_b_proj's per-head rows, o_proj's input) while
# every rank keeps the whole latent; the routed experts and the shared expert split as
# above. V2 with q LoRA and grouped top-k, V2-Lite without q LoRA, V3's sigmoid routing,
# V3.2's sparse attention.
MLA_TP = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8,
              qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=2, max_position_embeddings=256,
              tie_word_embeddings=False)
DEEPSEEK_TP = {
    "v2": ("deepseek_v2", dict(q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                               topk_group=2, routed_scaling_factor=2.5)),
    "v2_lite": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy")),
    "v3": ("deepseek_v3", dict(q_lora_rank=48, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5, norm_topk_prob=True)),
    # V3.2: the lightning indexer is every rank's whole (each selects the same top-4).
    "v32": ("deepseek_v32", dict(q_lora_rank=48, n_group=4, topk_group=2,
                                 routed_scaling_factor=2.5, index_topk=4, index_n_heads=9,
                                 index_head_dim=16)),
}


@pytest.mark.parametrize("variant", list(DEEPSEEK_TP))
def test_two_ranks_split_mla_heads_and_generate_what_one_rank_does(tmp_path, variant):
    from tiny_checkpoints import build_tiny_checkpoint

    model_type, overrides = DEEPSEEK_TP[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, **MLA_TP, **overrides,
                                 random_buffers=("e_score_correction_bias",))
    decisions = _two_ranks_match_one(path, max_tokens=16, logprob_tol=1e-4)
    assert "whole MLA latent cache" in decisions["tensor parallel"].reason


QUANT_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "quant")
# Real checkpoints of the quantizers (tests/fixtures/quant): every scheme whose parts a rank
# can keep whole. Each rank keeps its rows (column-parallel) or input channels (row-parallel)
# of the packed integers, scales, zero points and groups.
TP_QUANTIZED = ["awq-w4-g64", "gptq-w4-g128-sym", "gptq-w8-g128", "ct-w4a16-g32-asym",
                "ct-w8a16-g128", "ct-fp8-tensor-static"]
# Activations quantized per token as they arrive: a row-parallel rank scales its own part of
# the row (as vLLM's ranks do), so two ranks round the activations differently from one.
TP_DYNAMIC_ACTIVATIONS = ["ct-int8-w8a8", "ct-fp8-channel-dynamic",
                          # Qwen3-MoE: its fp8 experts split too (rows of gate/up, input
                          # channels of down, per-row scales with them).
                          "ct-moe-fp8-dynamic"]


@pytest.mark.parametrize("name", TP_QUANTIZED)
def test_two_ranks_split_a_quantized_checkpoint_and_generate_what_one_rank_does(name):
    _two_ranks_match_one(os.path.join(QUANT_FIXTURES, name), max_tokens=8, logprob_tol=1e-3,
                         max_model_len=64)


@pytest.mark.parametrize("name", TP_DYNAMIC_ACTIVATIONS)
def test_two_ranks_with_per_token_activation_scales_stay_close_to_one(name):
    """Prompt log-probabilities (every position, teacher-forced) within the activation
    rounding's reach (measured: mean 0.03-0.08, max 0.18-0.20 nats on these fixtures); a
    rank that kept the wrong rows or scales would be off by whole nats."""
    path = os.path.join(QUANT_FIXTURES, name)
    common = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)
    asked = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = "The capital of France is Paris, and the capital of Spain is"
    one = LLM(path, **common).generate(prompt, asked)[0]
    tp = LLM(path, tensor_parallel_size=2, **common)
    try:
        two = tp.generate(prompt, asked)[0]
    finally:
        tp.llm_engine.shutdown()
    diffs = [abs(a[t].logprob - b[t].logprob) for a, b, t in
             zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], one.prompt_token_ids[1:],
                 strict=True)]
    assert max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.15, diffs


# What cannot split says why, before any worker loads a weight: block-FP8 scales cover 128
# output rows and each rank's k/v part is 64 rows; GPTQ's act order spreads every group over
# all input channels; a 128-channel group of a 128-wide o_proj would straddle the ranks.
@pytest.mark.parametrize("name,reason", [
    ("hf-fp8-block", "covers 128 output rows"),
    ("gptq-w4-g32-asym-actorder", "act order"),
    ("ct-moe-w4a16", "covers 128 input channels")])
def test_a_quantized_checkpoint_that_cannot_split_is_refused_with_its_reason(name, reason):
    with pytest.raises(Exception, match=reason) as refused:
        LLM(os.path.join(QUANT_FIXTURES, name), device="cpu", dtype="float32",
            max_model_len=64, tensor_parallel_size=2)
    assert reason in str(refused.value).splitlines()[0]     # the reason first, then a trace


# Four ranks of two query heads each: kv4 gives each rank one KV head of its own; kv2
# replicates each KV head on two ranks. Four gloo workers share CI's two cores, so the
# generation is short; the token logprobs check more than the ids of a tiny random model.
@pytest.mark.parametrize("variant", ["llama-8q4kv", "llama-8q2kv"])
def test_four_ranks_generate_the_tokens_one_rank_does(tiny_checkpoint, variant):
    path = tiny_checkpoint(variant)
    common = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    one = LLM(path, **common).generate(PROMPTS, params)
    tp = LLM(path, tensor_parallel_size=4, **common)
    try:
        four = tp.generate(PROMPTS, params)
        for a, b in zip(one, four, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            assert len(b.outputs[0].token_ids) == 8
            for pos_one, pos_four, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                                a.outputs[0].token_ids, strict=True):
                assert pos_four[token].logprob == pytest.approx(pos_one[token].logprob,
                                                                abs=1e-4)
        layout = {d.what: d for d in tp.llm_engine.report.decisions}["tensor parallel"]
        assert layout.chosen.startswith("4 ranks, gloo, mp")
        assert "rank 3: query heads 6..7" in layout.reason
        replicated = variant.endswith("2kv")
        assert ("KV head 1 (replicated on 2 ranks)" in layout.reason) == replicated
        # What the bench's roofline counts: one rank's heads and vocabulary rows.
        engine = tp.llm_engine
        assert len(engine.report.rank_memory) == 4
        facts = model_facts(engine)
        mc = engine.model_config
        assert facts.num_heads == 2
        assert facts.lm_head_params == mc.vocab_size // 4 * mc.hidden_size
    finally:
        tp.llm_engine.shutdown()


def test_a_killed_worker_fails_the_engine_cleanly_and_a_restart_works(tiny_checkpoint):
    from archserve.distributed.executor import WorkerFailure
    from archserve.serve.async_engine import AsyncEngine

    path = tiny_checkpoint("llama")
    common = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                  tensor_parallel_size=2)
    llm = LLM(path, **common)
    pids = llm.llm_engine.runner.executor.pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    served = AsyncEngine(llm.llm_engine)
    served.start()
    try:
        import asyncio

        async def one_request():
            return [o async for o in served.generate("r1", PROMPTS[0], SamplingParams(
                max_tokens=200, temperature=0.0, ignore_eos=True))]

        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(Exception, match="rank 1"):
            asyncio.run(one_request())
        # The loop is dead: /health reads is_alive and answers 503 with this reason.
        deadline = time.time() + 10
        while served.is_alive and time.time() < deadline:
            time.sleep(0.05)
        assert not served.is_alive and "rank 1" in served.dead_reason
        with pytest.raises(WorkerFailure):
            llm.generate(PROMPTS[0], GREEDY)
    finally:
        served.shutdown()
    deadline = time.time() + 15
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a worker outlived its failed engine"
    again = LLM(path, **common)
    try:
        assert len(again.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == 32
    finally:
        again.llm_engine.shutdown()
