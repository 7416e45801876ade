"""Speculative decoding on the GPU, as it is served: CUDA graphs (decode graphs, and the
mixed-step graphs that verification steps replay) and asynchronous scheduling. Every
method gives plain decoding's tokens, up to where bf16 holds a near-tie (a verification
step computes its rows in one GEMM, a decode step in another: their last bits differ), and
leaks no KV block.
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import build_tiny_mtp_checkpoint

from archserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3 1 2 3 1 2", "A paged KV cache stores keys and values in fixed-size blocks.",
           "Once upon a time", "def main():", "The quick brown fox", "1 2 3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
NEAR_TIE = 0.1    # the plain run's top two log-probs at a parting: within bf16 noise
ENGINE = dict(dtype="bfloat16", kv_cache_memory_bytes=1 << 28, max_num_seqs=8,
              self_check=False)
# DeepSeek-V3 MLA dims every GPU MLA kernel takes (tests/models/test_deepseek_vs_hf.py).
GPU_V3 = dict(hidden_size=256, intermediate_size=256, kv_lora_rank=256, qk_rope_head_dim=64,
              head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=64,
              max_position_embeddings=1024)


def assert_same_up_to_near_ties(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
        parting = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if parting is None:
            assert len(a) == len(b)
            continue
        top = sorted((lp.logprob for lp in w.outputs[0].logprobs[parting].values()),
                     reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (parting, a, b)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return build_tiny_mtp_checkpoint(str(tmp_path_factory.mktemp("gpu-mtp")),
                                     predicts_next=True, **GPU_V3)


def _count_replays(graph_runner, counter: list) -> None:
    replay = graph_runner.replay

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter.append(1)
        return replay(*args, **kwargs)
    graph_runner.replay = counting


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_speculation_in_cuda_graphs_with_async_scheduling(tiny_checkpoint, mtp_checkpoint,
                                                           method):
    path = mtp_checkpoint if method == "mtp" else tiny_checkpoint("llama-h64")
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": path,
                            "num_speculative_tokens": 4},
            "mtp": {"method": "mtp", "num_speculative_tokens": 3}}[method]
    plain = LLM(path, async_scheduling=True, **ENGINE)
    want = plain.generate(PROMPTS, GREEDY)
    del plain
    torch.cuda.empty_cache()
    llm = LLM(path, async_scheduling=True, speculative_config=spec, **ENGINE)
    engine = llm.llm_engine
    assert engine.config.async_scheduling and engine.report.graph_sizes
    mixed = engine.runner.mixed_graphs
    assert mixed is not None and mixed.set.sizes, "verification steps need mixed-step graphs"
    verified, drafted = [], []
    _count_replays(mixed, verified)
    drafts = getattr(engine.speculator.proposer, "runner", None)
    if drafts is not None:    # the draft network's chained forwards replay its graphs
        assert drafts.graphs is not None and drafts.graphs.set.sizes
        _count_replays(drafts.graphs, drafted)
    got = llm.generate(PROMPTS, GREEDY)
    assert_same_up_to_near_ties(got, want)
    assert engine.block_pool.num_used_blocks == 0
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and verified
    assert drafts is None or drafted
