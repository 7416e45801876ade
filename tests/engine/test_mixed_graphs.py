"""Steps with prompt tokens in CUDA graphs (cudagraph_mode FULL): vLLM's compilation_config
as archserve reads it, the token buckets, and the padding a captured bucket replays with.

The padding is checked on the CPU through the real model and the Triton attention kernel
under Triton's interpreter: a step copied into a bucket's static buffers and run there
gives the same logits as the step run as it is. The capture itself is the GPU test.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import types

import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.engine.compilation_config import CompilationChoice, parse_compilation_config
from archserve.engine.cuda_graphs import StaticGraphRunner
from archserve.engine.mixed_graphs import (
    TOKEN_BUCKETS,
    host_bound_tokens,
    mixed_graph_buckets,
)


def test_compilation_config_takes_vllms_cudagraph_keys():
    assert parse_compilation_config(None) == CompilationChoice("FULL", ())
    assert parse_compilation_config({"cudagraph_mode": "full"}).cudagraph_mode == "FULL"
    assert parse_compilation_config('{"cudagraph_mode": "NONE"}').cudagraph_mode == "NONE"
    choice = parse_compilation_config({"cudagraph_capture_sizes": [8, 1, 8, 4]})
    assert choice == CompilationChoice("FULL", (1, 4, 8))
    # vLLM's -O3 / {"level": 3}: on a CPU, compiled decode steps (engine/cpu_compiled_step.py).
    assert parse_compilation_config("3") == CompilationChoice(level=3)
    assert parse_compilation_config({"level": 0}).level == 0


@pytest.mark.parametrize("value, message", [
    ({"cudagraph_mode": "PIECEWISE"}, "split around attention"),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, "split around attention"),
    ({"cudagraph_mode": "SOMETIMES"}, "unknown cudagraph_mode"),
    ({"debug_dump_path": "/tmp"}, "debug_dump_path not supported"),
    ({"level": 7}, "not one of 0-3"),
    ({"cudagraph_capture_sizes": [0]}, "positive integers"),
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
])
def test_compilation_config_refuses_what_archserve_lacks(value, message):
    with pytest.raises(ValueError, match=message):
        parse_compilation_config(value)


def test_an_engine_refuses_a_bad_compilation_config_and_runs_a_good_one(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="split around attention"):
        LLM(path, dtype="float32", compilation_config={"cudagraph_mode": "PIECEWISE"})
    # On a CPU there are no graphs to capture: FULL is accepted, and the start-up says why
    # it changes nothing.
    llm = LLM(path, dtype="float32", compilation_config={"cudagraph_mode": "FULL"})
    decision = next(d for d in llm.llm_engine.report.decisions if d.what == "cudagraph_mode")
    assert (decision.requested, decision.chosen) == ("FULL", "NONE")
    assert "CUDA graphs are off" in decision.reason
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    del llm
    # The default (FULL, not asked for) says nothing where there are no graphs.
    llm = LLM(path, dtype="float32")
    assert not [d for d in llm.llm_engine.report.decisions if d.what == "cudagraph_mode"]


def test_token_buckets_cover_every_step_size_up_to_the_largest():
    assert mixed_graph_buckets(8192) == list(TOKEN_BUCKETS)
    assert mixed_graph_buckets(2048) == list(TOKEN_BUCKETS)
    assert mixed_graph_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert mixed_graph_buckets(16) == [16]
    assert mixed_graph_buckets(10) == [10]
    # Each bucket is at most 2x the one below: a step pads by less than half its bucket.
    assert all(b <= 2 * a for a, b in zip(TOKEN_BUCKETS, TOKEN_BUCKETS[1:], strict=False))


def test_buckets_stop_where_a_steps_matmuls_would_bound_it():
    # 15 ms at 787 TFLOP/s: a 0.6B model's steps stay launch-bound to the ladder's end; an
    # 8B model's past ~780 tokens are compute-bound, so its last bucket is 768.
    assert host_bound_tokens(2 * 0.44e9, 7.87e14) == 2048
    assert host_bound_tokens(2 * 7.5e9, 7.87e14) == 768
    assert host_bound_tokens(2 * 7.5e9, 7.87e14, limit=512) == 512
    assert host_bound_tokens(2 * 400e9, 1e12) == 16          # never below one bucket



class _CapturedBuckets(StaticGraphRunner):
    """The graph runner's bookkeeping (keep_only, the canary's loop) over buckets that a
    CPU cannot capture: each graph stands in as None; its canary fails where asked."""

    def __init__(self, sizes: list[int], canary_fails: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        self.set.graphs = dict.fromkeys(sizes)
        self.set.sizes = list(sizes)
        self.canary_fails = canary_fails

    def _canary_blocks(self) -> int:
        return 0

    def _canary_at(self, size: int, tolerance: float) -> str | None:
        return "replayed output differs" if self.canary_fails else None


class _Rank:
    """What capture_mixed_step_graphs reads of a runner: its step weights, its device's
    ceilings (from runner.device, so each rank has its own) and the buckets it captured."""

    def __init__(self, matmul_flops_per_s: float, lacks: tuple[int, ...] = (),
                 capture_raises: bool = False, canary_fails: bool = False) -> None:
        self.device = types.SimpleNamespace(matmul_flops_per_s=matmul_flops_per_s)
        self.step_weights = types.SimpleNamespace(active_params_per_token=1e6)
        self.kv_caches, self.mixed_graphs = [], None
        self.lacks, self.capture_raises, self.canary_fails = lacks, capture_raises, canary_fails

    def replay_mixed_canary(self) -> str | None:
        return self.mixed_graphs.replay_canary(self.kv_caches)

    def capture_mixed_graphs(self, tokens: int, max_num_seqs: int, rows_per_seq: int = 1,
                             max_query_len: int | None = None) -> None:
        if self.capture_raises:
            raise torch.cuda.OutOfMemoryError("out of memory on this rank")
        sizes = [s for s in mixed_graph_buckets(tokens) if s not in self.lacks]
        self.mixed_graphs = _CapturedBuckets(sizes, self.canary_fails)


def _start_two_ranks(monkeypatch, ranks: list[_Rank]) -> list:
    """capture_mixed_step_graphs on two ranks in threads, agreeing through an in-process
    all-gather; each rank's Decision, or the exception it raised."""
    from archserve.distributed.agreement import RankAgreement
    from archserve.engine import runner_setup

    monkeypatch.setattr(runner_setup, "load_or_measure", lambda device: device)
    slots, barrier = [None, None], threading.Barrier(2, timeout=30)

    def gather(rank: int, value):
        slots[rank] = value
        barrier.wait()
        values = list(slots)
        barrier.wait()
        return values

    results: list = [None, None]

    def start(rank: int) -> None:
        agree = RankAgreement(lambda value: gather(rank, value), rank=rank)
        try:
            results[rank] = runner_setup.capture_mixed_step_graphs(ranks[rank], 2048, 8, agree)
        except Exception as exc:  # noqa: BLE001 - the test reports what a rank raised
            results[rank] = exc

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_tensor_parallel_ranks_capture_the_same_buckets_from_differing_rates(monkeypatch):
    """Each rank measures its own matmul rate (another node, or a cold calibration cache):
    near a bucket edge the ranks' compute-bound limits differ (15 ms of 2 MFLOP tokens:
    1050 tokens at one rate, 975 at the other), and the start must not fail on it."""
    ranks = [_Rank(1.4e11), _Rank(1.3e11)]
    results = _start_two_ranks(monkeypatch, ranks)
    assert [getattr(r, "chosen", r) for r in results] == ["FULL", "FULL"]
    assert ranks[0].mixed_graphs.set.sizes == ranks[1].mixed_graphs.set.sizes
    assert ranks[0].mixed_graphs.set.sizes[-1] == 768   # the smaller rank's limit


def test_a_bucket_one_rank_lacks_is_dropped_on_every_rank(monkeypatch):
    """One rank's capture of a bucket failed (its memory): the others drop it too, and say
    why, instead of the start failing on the disagreement."""
    ranks = [_Rank(1.3e11), _Rank(1.3e11, lacks=(256,))]
    results = _start_two_ranks(monkeypatch, ranks)
    assert [getattr(r, "chosen", r) for r in results] == ["FULL", "FULL"]
    assert 256 not in ranks[0].mixed_graphs.set.sizes
    assert ranks[0].mixed_graphs.set.sizes == ranks[1].mixed_graphs.set.sizes
    assert ranks[0].mixed_graphs.set.demoted == {256: "not captured on every rank"}
    assert "not captured on every rank" in results[0].reason


@pytest.mark.parametrize("failing", ["capture", "canary"])
def test_a_failure_on_one_rank_leaves_every_rank_decode_only(monkeypatch, failing):
    ranks = [_Rank(1.3e11), _Rank(1.3e11, capture_raises=failing == "capture",
                                  canary_fails=failing == "canary")]
    results = _start_two_ranks(monkeypatch, ranks)
    assert [getattr(r, "chosen", r) for r in results] == ["FULL_DECODE_ONLY"] * 2
    assert all(rank.mixed_graphs is None for rank in ranks)
    assert ("OutOfMemoryError" if failing == "capture" else "replayed output differs") \
        in results[1].reason


def test_a_buckets_padding_stays_inside_what_a_real_step_can_address():
    # A 512-token bucket over four 70-token prompts of a 128-token model: the padding
    # sequence (232 tokens, longer than any real one) sits in the last sequence slot of
    # the static buffers, where a column past its block-table row is past the buffer.
    import torch

    from archserve.engine.mixed_graphs import MixedGraphRunner
    from archserve.kernels.attention.interface import AttentionMetadata
    block_size, max_model_len, seqs, q = 16, 128, 4, 70
    max_blocks = max_model_len // block_size
    mixed = MixedGraphRunner(None, torch.device("cpu"), 2048, seqs, max_blocks, max_model_len,
                             block_size)
    tables = torch.arange(seqs * 5, dtype=torch.int32).view(seqs, 5)
    meta = AttentionMetadata.from_lengths([q] * seqs, [q] * seqs, tables,
                                          torch.arange(seqs * q), "cpu")
    positions = torch.arange(q).repeat(seqs)
    bucket = 512
    mixed.load(bucket, torch.zeros(seqs * q, dtype=torch.long), positions, meta,
               torch.arange(1, seqs + 1) * q - 1)
    slots = mixed.seq_slots(bucket)
    assert mixed.seq_lens[seqs].item() == bucket - seqs * q   # the padding sequence
    # Every position is one the model's rotary table has (a real step's are below
    # max_model_len), and every slot's context fits its own block-table row.
    assert int(mixed.positions[:bucket].max()) < max_model_len
    widths = -(-mixed.seq_lens[:slots] // block_size)
    assert int(widths.max()) <= mixed.block_tables.shape[1]
    assert torch.equal(mixed.positions[:seqs * q], positions)
    assert torch.equal(mixed.block_tables[:seqs, :5], tables)
    assert not mixed.block_tables[seqs:slots].any()     # padding reads block 0 only


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import written_steps
from archserve import LLM
from archserve.engine.mixed_graphs import MixedGraphRunner

llm = LLM(sys.argv[1], attention_backend="TRITON_ATTN", dtype="float32", max_model_len=128,
          max_num_seqs=4)
runner = llm.llm_engine.runner
generator = torch.Generator().manual_seed(0)
for kv in runner.kv_caches:
    kv.copy_(torch.randn(kv.shape, generator=generator))
mixed = MixedGraphRunner(runner._forward_rows, runner.device, 64, 4, runner.max_blocks_per_seq,
                         runner.max_model_len, runner.block_size)

def written_step():
    # A decode at position 20, a 9-token chunk after a 7-token prefix, a fresh 5-token
    # prompt: each sequence its own blocks, every token's KV written to its slot.
    return written_steps.written_step([1, 9, 5], [21, 16, 5], runner.block_size)

cases = [(16, mixed.canary_step(16, 8)), (64, mixed.canary_step(64, 8)), (16, written_step()),
         (32, written_step())]
result = []
with torch.inference_mode():
    for bucket, (ids, positions, meta, rows) in cases:
        eager = runner._forward_rows(ids, positions, meta, rows)
        mixed.load(bucket, ids, positions, meta, rows)
        padded = mixed._forward_at(bucket)
        result.append({"bucket": bucket, "tokens": int(ids.shape[0]),
                       "err": (eager - padded[:rows.shape[0]]).abs().max().item(),
                       "finite": bool(torch.isfinite(padded).all()),
                       "scale": eager.abs().max().item()})
print(json.dumps(result))
"""


def test_a_step_padded_into_a_bucket_gives_the_same_logits(tiny_checkpoint):
    path = tiny_checkpoint("llama-h64")   # the Triton backend takes heads of 32 and up
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, os.path.dirname(__file__)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [c["bucket"] for c in cases] == [16, 64, 16, 32]
    assert all(c["tokens"] < c["bucket"] for c in cases)   # every case is padded
    for case in cases:
        assert case["finite"], case
        assert case["err"] <= 1e-4 * max(1.0, case["scale"]), case


@pytest.mark.gpu
def test_gpu_full_cudagraph_mode_replays_mixed_steps_and_matches_eager(tiny_checkpoint):
    """FULL captures the buckets, passes its replay canary, and a mixed workload (prompts
    arriving beside running decodes, chunked) gives the tokens of FULL_DECODE_ONLY."""
    path = tiny_checkpoint("llama-h64")
    # Three tokens a word: the longest prompt and its output stay within max_model_len 256.
    prompts = [" ".join(["word"] * n) for n in (3, 20, 50, 7, 70, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for mode in ("FULL", "FULL_DECODE_ONLY"):
        llm = LLM(path, dtype="float32", gpu_memory_utilization=0.2, max_num_batched_tokens=64,
                  compilation_config={"cudagraph_mode": mode})
        decision = next(d for d in llm.llm_engine.report.decisions
                        if d.what == "cudagraph_mode")
        assert decision.chosen == mode, decision
        if mode == "FULL":   # no name kept for the runner: it would hold its KV pool
            assert llm.llm_engine.runner.mixed_graphs.set.sizes
            assert not llm.llm_engine.runner.mixed_graphs.set.demoted
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
        del llm     # the next engine sizes its pool from the memory this one frees
        gc.collect()
        torch.cuda.empty_cache()
    # A padded bucket multiplies more rows than the eager step, so its GEMMs may round
    # differently: the tokens agree, or first part at a near tie of the eager run's top two.
    for full, eager in zip(outs["FULL"], outs["FULL_DECODE_ONLY"], strict=True):
        for step, (a, b) in enumerate(zip(full.token_ids, eager.token_ids, strict=True)):
            if a != b:
                top = eager.logprobs[step]
                assert a in top and abs(top[a].logprob - top[b].logprob) < 1e-3, (step, top)
                break
