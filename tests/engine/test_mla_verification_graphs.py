"""An MLA target's verification steps in a captured bucket (engine/mixed_graphs.py with a
query limit of k + 1): the padding, the verification-shaped replay canary and the decode
rows (kernels/mla/decode_rows.py) checked on the CPU through a tiny DeepSeek-V3 model and
TRITON_MLA's kernels under Triton's interpreter. A step copied into a bucket's static
buffers and run there gives the logits of the step run as it is; the capture itself is
tests/engine/test_spec_decode_gpu.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from tiny_checkpoints import build_tiny_mtp_checkpoint

from archserve.engine.mixed_graphs import MixedGraphRunner

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import written_steps
from archserve import LLM
from archserve.engine.mixed_graphs import MixedGraphRunner
from archserve.kernels.mla.triton_mla import TritonMlaImpl

llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=4)
runner = llm.llm_engine.runner
runner.attn_impl = TritonMlaImpl()     # TRITON_MLA's kernels, interpreted (a GPU backend)
generator = torch.Generator().manual_seed(0)
for kv in runner.kv_caches:
    kv.copy_(torch.randn(kv.shape, generator=generator))
k = 3
mixed = MixedGraphRunner(runner._forward_rows, runner.device, 32, 4, runner.max_blocks_per_seq,
                         runner.max_model_len, runner.block_size, rows_per_seq=k + 1,
                         max_query_len=k + 1)

def verification_step():
    # Sequences verifying 3, 0 and 2 drafts over contexts of 20, 9 and 33 tokens, each in
    # its own blocks, every token's latent written to its slot; every row sampled.
    return written_steps.written_step([4, 1, 3], [24, 10, 36], runner.block_size,
                                      every_row=True)

cases = [(16, mixed.canary_step(16, 8)), (32, mixed.canary_step(32, 8)),
         (16, verification_step())]
result = []
with torch.inference_mode():
    for bucket, (ids, positions, meta, rows) in cases:
        cache_before = [kv.clone() for kv in runner.kv_caches]
        eager = runner._forward_rows(ids, positions, meta, rows)
        for kv, before in zip(runner.kv_caches, cache_before):
            kv.copy_(before)       # the bucket writes the same rows over the same cache
        mixed.load(bucket, ids, positions, meta, rows)
        padded = mixed._forward_at(bucket)
        result.append({"bucket": bucket, "tokens": int(ids.shape[0]),
                       "query_lens": meta.query_lens_cpu, "rows": int(rows.shape[0]),
                       "replays": mixed.bucket_for(ids.shape[0], meta.num_seqs,
                                                   rows.shape[0], meta.max_query_len),
                       "err": (eager - padded[:rows.shape[0]]).abs().max().item(),
                       "finite": bool(torch.isfinite(padded).all()),
                       "scale": eager.abs().max().item()})
# A step with a longer prompt chunk is not one this runner replays.
result.append({"prompt_chunk_bucket": mixed.bucket_for(12, 2, 2, 9)})
print(json.dumps(result))
"""


def test_a_verification_step_padded_into_a_bucket_gives_the_same_logits(tmp_path):
    path = build_tiny_mtp_checkpoint(str(tmp_path / "v3"))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, os.path.dirname(__file__)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *cases, refused = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [c["bucket"] for c in cases] == [16, 32, 16]
    for case in cases:
        assert case["tokens"] < case["bucket"], case         # every case is padded
        assert max(case["query_lens"]) == 4 and case["rows"] == case["tokens"], case
        assert case["finite"], case
        assert case["err"] <= 1e-4 * max(1.0, case["scale"]), case
    assert refused == {"prompt_chunk_bucket": None}


def test_the_canary_step_of_a_limited_runner_keeps_to_its_limit():
    # Every bucket's canary: a decode beside sequences of k + 1 tokens over cached prefixes
    # of differing lengths, padded, every row sampled where the LM head has room, no more
    # sequences than the bucket's slots leave beside the padding one.
    for k, seqs, max_tokens in ((3, 8, 32), (7, 256, 2048), (1, 4, 16)):
        mixed = MixedGraphRunner(None, torch.device("cpu"), max_tokens, seqs, 8, 128, 16,
                                 rows_per_seq=k + 1, max_query_len=k + 1)
        for bucket in (16, max_tokens):
            ids, positions, meta, rows = mixed.canary_step(bucket, 8)
            assert meta.max_query_len == k + 1 and meta.query_lens_cpu[0] == 1
            lens = meta.seq_lens_cpu
            assert len(set(lens[:10])) == min(10, len(lens)) and max(lens) <= 128
            assert ids.shape[0] < bucket and meta.num_seqs + 1 <= mixed.seq_slots(bucket)
            assert mixed.bucket_for(ids.shape[0], meta.num_seqs, rows.shape[0],
                                    meta.max_query_len) == bucket or not mixed.set.sizes
            assert rows.shape[0] <= mixed.row_slots(bucket)
            starts = torch.tensor([0, *meta.query_lens_cpu]).cumsum(0)
            for i, (q, n) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu,
                                           strict=True)):
                assert positions[starts[i]:starts[i + 1]].tolist() == list(range(n - q, n))
