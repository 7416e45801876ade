"""A verification step run as decode rows (kernels/attention/decode_rows.py): each token a
row of the decode kernel over its sequence's blocks with its own causal length, the step
then a decode step of B x (k + 1) rows (engine/model_runner.py ``runs_as_decode_rows``,
engine/batch.py), which replays the decode graph of that many rows on a GPU.

Checked on the CPU through TRITON_ATTN's kernels under Triton's interpreter (a child
process: the interpreter must be on before triton is imported), on a tiny Llama (GQA) and
a tiny gpt-oss (attention sinks, a sliding window of 4 keys on every other layer): the
rows' logits are the varlen kernel's for the same step, and greedy generation with n-gram
drafts verified as decode rows is plain decoding's. The graphs' replay is
tests/engine/test_spec_decode_gpu.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_checkpoints import build_tiny_checkpoint

from archserve.engine.cuda_graphs import decode_graph_sizes, default_graph_sizes
from archserve.kernels.attention.decode_rows import decode_rows_metadata, host_decode_rows

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import written_steps
from archserve import LLM, SamplingParams
from archserve.kernels.attention.decode_rows import decode_rows_metadata
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.triton_backend import TritonAttentionImpl

path = sys.argv[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROMPTS = ["1 2 3 1 2 3 1 2", "The quick brown fox", "Hello world! How are you"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)

def engine(**kwargs):
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4, **kwargs)
    runner = llm.llm_engine.runner
    runner.attn_impl = TritonAttentionImpl()   # TRITON_ATTN's kernels, interpreted
    return llm, runner

result = {}
llm, runner = engine()
generator = torch.Generator().manual_seed(0)
for kv in runner.kv_caches:
    kv.copy_(torch.randn(kv.shape, generator=generator))
# Sequences verifying 3, 0 and 2 drafts over contexts of 24, 10 and 36 tokens (past the
# window), every token's keys written to its slot, every row sampled.
query_lens, seq_lens = [4, 1, 3], [24, 10, 36]
ids, positions, meta, rows = written_steps.written_step(query_lens, seq_lens,
                                                        runner.block_size, every_row=True)
ones, row_lens, tables = decode_rows_metadata(query_lens, seq_lens, meta.block_tables.numpy())
as_rows = AttentionMetadata.from_lengths(ones, row_lens, tables, meta.slot_mapping, "cpu")
cache = [kv.clone() for kv in runner.kv_caches]
with torch.inference_mode():
    varlen = runner._forward_rows(ids, positions, meta, rows)
    for kv, before in zip(runner.kv_caches, cache):
        kv.copy_(before)
    decoded = runner._forward_rows(ids, positions, as_rows, rows)
result["err"] = (varlen - decoded).abs().max().item()
result["scale"] = varlen.abs().max().item()
result["rows_meta"] = [as_rows.num_seqs, as_rows.max_query_len, as_rows.seq_lens_cpu]
del llm, runner

plain, _ = engine()
want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS)]
del plain
llm, runner = engine(speculative_config=NGRAM)
runner.decode_rows_query_len = NGRAM["num_speculative_tokens"] + 1   # TRITON_ATTN's limit
decided = []
runs_as_decode_rows = runner.runs_as_decode_rows
def recording(chunks):
    decided.append(runs_as_decode_rows(chunks))
    return decided[-1]
runner.runs_as_decode_rows = recording
got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
stats = llm.llm_engine.speculator.stats
result.update(same=got == want, got=got, want=want, decode_row_steps=sum(decided),
              accepted=stats.num_accepted_tokens, drafted=stats.num_draft_tokens,
              used_blocks=llm.llm_engine.block_pool.num_used_blocks)
print(json.dumps(result))
"""

GPT_OSS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=4, tie_word_embeddings=False, max_position_embeddings=256)


@pytest.mark.parametrize("model", ["llama", "gpt_oss"])
def test_verification_as_decode_rows_is_the_varlen_step_and_lossless(tmp_path, model):
    overrides = (dict(hidden_size=128, head_dim=32, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
                 if model == "llama" else GPT_OSS)
    path = build_tiny_checkpoint(str(tmp_path / model), model, **overrides)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, os.path.dirname(__file__)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 8 rows, each one query token over its own causal length.
    assert result["rows_meta"] == [8, 1, [21, 22, 23, 24, 10, 34, 35, 36]], result
    assert result["err"] <= 1e-4 * max(1.0, result["scale"]), result
    assert result["same"], result
    assert result["decode_row_steps"] > 0 and result["accepted"] > 0, result
    assert result["used_blocks"] == 0, result


def test_decode_rows_metadata_gives_each_token_its_sequence_table_and_causal_length():
    tables = np.array([[5, 6, 0], [7, 0, 0], [8, 9, 4]], dtype=np.int32)
    ones, lens, rows = decode_rows_metadata(np.array([2, 1, 3]), np.array([17, 4, 40]), tables)
    assert ones.tolist() == [1] * 6 and ones.dtype == np.int32
    assert lens.tolist() == [16, 17, 4, 38, 39, 40] and lens.dtype == np.int32
    assert rows.tolist() == [[5, 6, 0], [5, 6, 0], [7, 0, 0],
                             [8, 9, 4], [8, 9, 4], [8, 9, 4]]
    tokens, seqs, _ = host_decode_rows(np.array([2, 1, 3]), np.array([17, 4, 40]))
    assert tokens.tolist() == list(range(6)) and seqs.tolist() == [0, 0, 1, 2, 2, 2]


def test_the_decode_graph_ladder_reaches_the_verification_rows():
    # Without decode rows: the ladder up to max_num_seqs; with them up to k + 1 rows a
    # sequence (a full batch's step included), capped at DECODE_ROWS_GRAPH_LIMIT.
    assert decode_graph_sizes(32) == default_graph_sizes(32)
    assert decode_graph_sizes(32, 9) == default_graph_sizes(288)
    assert decode_graph_sizes(8, 5) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_graph_sizes(1, 4) == [1, 2, 4]
    assert decode_graph_sizes(1, 3) == [1, 2, 3]
    assert decode_graph_sizes(256, 5)[-1] == 512
    assert decode_graph_sizes(1024, 5) == default_graph_sizes(1024)   # never fewer
