"""Speculative decoding on the GPU, as it is served: CUDA graphs and asynchronous
scheduling. Every method gives plain decoding's tokens, up to where bf16 holds a near-tie
(a verification step computes its rows in one GEMM, a decode step in another: their last
bits differ), and leaks no KV block.

Verification steps run as decode rows for every target here (kernels/attention/
decode_rows.py): each token a row of the decode kernel with its own causal length, the step
a replay of the decode graph of B x (k + 1) rows: TRITON_ATTN's (the Llama targets),
TRITON_MLA's (the MTP case), TRITON_MLA_SPARSE's (n-gram drafts and the MTP layer of a
DeepSeek-V3.2, which selects its keys per row too). A step of more rows than the largest
decode graph replays a mixed-step bucket: TRITON_ATTN's capture any step with prompt
tokens, an MLA target's the steps whose every sequence brings at most k + 1 query tokens.
The draft network's forwards replay graphs of their own.
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint, build_tiny_mtp_checkpoint

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
# The target's decoder layers are dense (first_k_dense_replace: all of them): in bf16 a
# verification step's rounding swaps near-tied experts now and then (tests/models/
# test_deepseek_vs_hf.py: up to ~0.6 of a token's log-prob), which parts the runs beyond a
# near-tie without any fault of speculation. The MTP layer's block (after them) keeps its
# experts: they shape drafts only.
GPU_V3 = dict(hidden_size=256, intermediate_size=256, kv_lora_rank=256, qk_rope_head_dim=64,
              head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=64,
              max_position_embeddings=1024, first_k_dense_replace=2)


def partings_beyond_near_ties(got, want) -> list[str]:
    """Each prompt whose speculative tokens part from the plain run's where the plain run's
    top two log-probs are further apart than NEAR_TIE (or that ends at another length),
    described: the position, both tokens, the plain run's top two and what each run gave
    that row."""
    found = []
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
        parting = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if parting is None:
            if len(a) != len(b):
                found.append(f"{prompt!r}: {len(a)} tokens with drafts, {len(b)} without")
            continue
        plain_row = w.outputs[0].logprobs[parting]
        top = sorted(plain_row.items(), key=lambda kv: kv[1].logprob, reverse=True)
        if top[0][1].logprob - top[1][1].logprob < NEAR_TIE:
            continue
        spec_top = sorted(((t, round(lp.logprob, 3))
                           for t, lp in g.outputs[0].logprobs[parting].items()),
                          key=lambda pair: -pair[1])
        found.append(
            f"{prompt!r}: token {parting} is {a[parting]} with drafts, {b[parting]} without; "
            f"the plain run's top two {[(t, round(lp.logprob, 3)) for t, lp in top[:2]]}, "
            f"the speculative run's {spec_top}; before it: {b[max(0, parting - 8):parting]}")
    return found


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return build_tiny_mtp_checkpoint(str(tmp_path_factory.mktemp("gpu-mtp")),
                                     predicts_next=True, **GPU_V3)


def sparse_mla_checkpoint(path: str, mtp: bool = False) -> str:
    """A tiny DeepSeek-V3.2 (TRITON_MLA_SPARSE: latent 256 + 64, 16 indexer heads) whose
    contexts pass its top-16, its decoder layers dense as the MTP target's are. ``mtp``:
    with a next-token MTP layer, the LM head the embedding (the target often repeats its
    newest token, which that layer drafts right)."""
    from models.test_sparse_mla_vs_hf import GPU_DSA, RANDOM_BUFFERS
    sizes = {**GPU_DSA, "index_topk": 16, "first_k_dense_replace": GPU_DSA["num_hidden_layers"]}
    if mtp:
        return build_tiny_mtp_checkpoint(path, "deepseek_v32", predicts_next=True,
                                         **{**sizes, "tie_word_embeddings": True})
    return build_tiny_checkpoint(path, "deepseek_v32", random_buffers=RANDOM_BUFFERS, **sizes)


def _count_replays(graph_runner, counter: list) -> None:
    replay = graph_runner.replay

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter.append(1)
        return replay(*args, **kwargs)
    graph_runner.replay = counting


def _count_decode_row_replays(runner, counter: list) -> None:  # noqa: ANN001
    """Count the decode-graph replays of steps whose tokens ran as decode rows."""
    decide, replay = runner.runs_as_decode_rows, runner.graphs.replay
    as_rows = [False]

    def deciding(chunks):  # noqa: ANN001, ANN202
        as_rows[0] = decide(chunks)
        return as_rows[0]

    def replaying(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if as_rows[0]:
            counter.append(1)
        return replay(*args, **kwargs)
    runner.runs_as_decode_rows, runner.graphs.replay = deciding, replaying


def _graph_decisions(engine) -> str:  # noqa: ANN001
    return "; ".join(f"{d.what}: {d.chosen} ({d.reason})" for d in engine.report.decisions
                     if "graph" in d.what or d.what == "speculative decoding")


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp", "ngram-sparse-mla",
                                    "mtp-sparse-mla"])
def test_speculation_in_cuda_graphs_with_async_scheduling(tiny_checkpoint, mtp_checkpoint,
                                                           tmp_path, method):
    if method == "mtp":
        path = mtp_checkpoint
    elif method.endswith("sparse-mla"):
        path = sparse_mla_checkpoint(str(tmp_path / "v32"), mtp=method.startswith("mtp"))
    else:
        path = tiny_checkpoint("llama-h64")
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1},
            "ngram-sparse-mla": {"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": path,
                            "num_speculative_tokens": 4},
            "mtp": {"method": "mtp", "num_speculative_tokens": 3},
            "mtp-sparse-mla": {"method": "mtp", "num_speculative_tokens": 3}}[method]
    plain = LLM(path, async_scheduling=True, **ENGINE)
    want = plain.generate(PROMPTS, GREEDY)
    del plain
    torch.cuda.empty_cache()
    llm = LLM(path, async_scheduling=True, speculative_config=spec, **ENGINE)
    engine = llm.llm_engine
    decisions = _graph_decisions(engine)
    assert engine.config.async_scheduling and engine.report.graph_sizes, decisions
    attention = engine.report.attention
    assert not method.endswith("sparse-mla") or attention.name == "TRITON_MLA_SPARSE", \
        decisions
    mixed = engine.runner.mixed_graphs
    as_rows, drafted = [], []
    assert mixed is not None and mixed.set.sizes, \
        f"{attention.name}: larger verification steps need mixed-step graphs; {decisions}"
    mode = next(d for d in engine.report.decisions if d.what == "cudagraph_mode") \
        if not attention.backend.mixed_graph_capturable else None
    if mode is not None:    # an MLA target: verification steps only, and it says so
        assert mixed.max_query_len == spec["num_speculative_tokens"] + 1, decisions
        assert mode.chosen == "FULL" and "verification steps" in mode.reason, decisions
    _count_decode_row_replays(engine.runner, as_rows)
    drafts = getattr(engine.speculator.proposer, "runner", None)
    if drafts is not None:    # the draft network's chained forwards replay its graphs
        assert drafts.graphs is not None and drafts.graphs.set.sizes, decisions
        _count_replays(drafts.graphs, drafted)
    got = llm.generate(PROMPTS, GREEDY)
    partings = partings_beyond_near_ties(got, want)
    assert not partings, f"{method} ({attention.name}): " + "\n".join(partings)
    assert engine.block_pool.num_used_blocks == 0, engine.block_pool.num_used_blocks
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0, (stats, decisions)
    assert as_rows, ("no verification step replayed a decode graph as decode rows",
                     decisions)
    assert drafts is None or drafted, ("the draft network replayed no graph", decisions)
