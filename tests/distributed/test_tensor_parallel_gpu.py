"""Tensor parallelism on two GPUs: NCCL ranks with CUDA graphs against one GPU, bf16."""

from __future__ import annotations

import pytest
import torch

from archserve import LLM
from archserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on nvidia-h200-x2)")]

PROMPTS = ["Hello world! How are you", "The capital of France is", "1 2 3 4 5",
           "Once upon a time there was"]


def test_two_gpus_generate_close_to_one_with_cuda_graphs(tiny_checkpoint):
    path = tiny_checkpoint("llama-h64")         # head size 64: every GPU backend runs it
    # A fixed KV budget, not a share of the card: the one-GPU engine's memory stays in this
    # process's caching allocator, and rank 0 shares GPU 0 with it (a share counts every
    # process's memory, so rank 0 would find room for no tokens).
    common = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=16,
                  kv_cache_memory_bytes=1 << 28)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    one = LLM(path, **common).generate(PROMPTS, greedy)
    tp = LLM(path, tensor_parallel_size=2, **common)
    try:
        two = tp.generate(PROMPTS, greedy)
        report = tp.llm_engine.report
        assert report.graph_sizes, "decode must run from CUDA graphs under TP"
        decisions = {d.what: d for d in report.decisions}
        assert decisions["tensor parallel"].chosen.startswith("2 ranks, nccl")
        assert "all-reduce" in decisions, "the all-reduce choice is made and reported"
        print("all-reduce:", decisions["all-reduce"].chosen, decisions["all-reduce"].reason)
        same_prefix = 0
        for a, b in zip(one, two, strict=True):
            # bf16 sums in another order: the first tokens agree, logprobs stay close.
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            same_prefix += next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
            for ra, rb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                tok = next(iter(ra))
                assert rb[tok].logprob == pytest.approx(ra[tok].logprob, abs=0.1)
        assert same_prefix >= 0.75 * 16 * len(PROMPTS)
    finally:
        tp.llm_engine.shutdown()
