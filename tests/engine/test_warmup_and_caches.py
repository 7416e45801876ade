"""Start-up work paid once: kernel cache keys, `archserve prepare`, the roofline self-check."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from archserve.engine.kernel_cache import configure_kernel_caches, kernel_cache_key
from archserve.engine.self_check import classify_kernel
from archserve.platform import get_profile


def test_kernel_cache_key_follows_device_driver_and_versions():
    h100, h200 = get_profile("h100"), get_profile("h200")
    assert kernel_cache_key(h100) != kernel_cache_key(h200)
    newer_driver = dataclasses.replace(
        h200, toolchain=dataclasses.replace(h200.toolchain, driver_version="999.1"))
    assert kernel_cache_key(newer_driver) != kernel_cache_key(h200)
    assert kernel_cache_key(h200) == kernel_cache_key(get_profile("h200"))


def test_kernel_caches_live_under_the_archserve_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert configure_kernel_caches(get_profile("cpu")) is None
    path = configure_kernel_caches(get_profile("h200"))
    assert path.startswith(str(tmp_path)) and os.environ["TRITON_CACHE_DIR"] == path
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")   # the user's choice wins
    assert configure_kernel_caches(get_profile("h200")) == "/somewhere/else"


@pytest.mark.parametrize("name, kind", [
    ("_decode_kernel", "attention"), ("_prefill_kernel", "attention"),
    ("_write_kv_kernel", "attention"), ("_merge_splits_kernel", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "linear"), ("nvjet_hsh_128x64", "linear"),
    ("triton_poi_fused_add_mul", "elementwise"), ("_rms_norm_kernel", "elementwise"),
    ("_gate_up_kernel", "moe"), ("_down_quant_kernel", "moe"), ("_route_kernel", "moe"),
    ("_sum_slots_kernel", "moe"), ("_down_sum_slots_kernel", "moe"),
    ("_skinny_gemm_kernel", "linear"),
])
def test_kernel_names_map_to_op_kinds(name, kind):
    assert classify_kernel(name) == kind


def test_prepare_reports_timings(tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "archserve.cli.main", "prepare", "--model",
                           tiny_checkpoint("llama"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["attention"] == "TORCH_SDPA"
    assert result["canary"] == ["TORCH_SDPA: passed"]
    assert set(result["timings_s"]) >= {"load_s", "select_and_canary_s", "total_s"}
    assert result["timings_s"]["total_s"] >= result["timings_s"]["load_s"]


@pytest.mark.gpu
def test_gpu_warm_start_skips_tuning_and_self_check_runs(tiny_checkpoint, tmp_path):
    """Two starts with the same cache: the second compiles and tunes nothing."""
    env = {**os.environ, "ARCHSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "archserve.cli.main", "prepare", "--model",
                               tiny_checkpoint("qwen2-h64"), "--dtype", "bfloat16",
                               "--max-num-seqs", "8", "--json"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout[proc.stdout.index("{"):]))
    cold, warm = runs
    assert cold["attention"] == "TRITON_ATTN" and cold["self_check"]
    assert warm["timings_s"]["select_and_canary_s"] < cold["timings_s"]["select_and_canary_s"]
    # The decode GEMM choice is timed once, then read from the cache.
    gemms = [next(d for d in run["decisions"] if d["what"] == "decode GEMMs") for run in runs]
    assert gemms[0]["chosen"] == "TRITON_SKINNY_GEMM" and "tuned in" in gemms[0]["reason"]
    assert "cached" in gemms[1]["reason"]
    assert warm["timings_s"]["decode_gemm_tuning_s"] < cold["timings_s"]["decode_gemm_tuning_s"]


@pytest.mark.parametrize("tokens, seqs, max_len, expected", [
    (8192, 256, 256, [256] * 32),
    (8192, 8, 256, [256] * 8),            # capped by max_num_seqs, none over max_model_len
    (1000, 8, 300, [300, 300, 300, 100]),
    (100, 8, 4096, [100]),
])
def test_memory_profile_builds_the_largest_legal_step(tokens, seqs, max_len, expected):
    from archserve.engine.model_runner import profile_sequence_lengths
    lens = profile_sequence_lengths(tokens, seqs, max_len)
    assert lens == expected and len(lens) <= seqs and max(lens) <= max_len


def test_prefill_warm_up_covers_each_tune_bucket_and_writes_nothing(tiny_checkpoint):
    import torch

    from archserve import LLM, SamplingParams
    from archserve.kernels.attention.triton_prefill import tune_bucket
    llm = LLM(tiny_checkpoint("llama"), max_model_len=256, max_num_seqs=4)
    runner = llm.llm_engine.runner
    llm.generate(["a cached prompt"], SamplingParams(max_tokens=3))
    before = [c.clone() for c in runner.kv_caches]
    batches = runner.warm_up_prefill(max_num_batched_tokens=4096, max_num_seqs=16)
    assert max(n for batch in batches for n in batch) <= 256  # never past max_model_len
    lengths = [batch[0] for batch in batches if len(batch) == 1]
    # Every bucket the engine can reach, in a length that is a multiple of 16 and one not.
    assert {tune_bucket(n) for n in lengths} == {tune_bucket(n) for n in range(1, 257)}
    assert {n % 16 == 0 for n in lengths if n > 1} == {True, False}
    # Batched prefills: 3 and 16 prompts (Triton's "divisible by 16" variant of a count),
    # and the largest step the scheduler can build (16 prompts of 256 tokens).
    assert [2] * 3 in batches and [2] * 16 in batches and [256] * 16 in batches
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    # The engine serves as before the warm-up.
    assert llm.generate(["a cached prompt"], SamplingParams(max_tokens=3))[0].outputs[0].text


@pytest.mark.parametrize("limit", [8192, 2048, 1100, 100])
def test_prefill_warm_up_reaches_each_bucket_under_any_length_threshold(limit):
    # A route may change with the prompt's length inside a tune bucket: a sparse-MLA layer
    # attends densely up to its top-k (DeepSeek-V3.2: 2048, in the bucket that runs to
    # 8192 here). Whatever the threshold, each bucket its shorter prompts reach is warmed
    # below it, in a length that is a multiple of 16 and in one that is not.
    from archserve.engine.model_runner import prefill_warm_up_lengths
    from archserve.kernels.attention.triton_prefill import tune_bucket

    lengths = prefill_warm_up_lengths(limit)
    assert max(lengths) <= limit and min(lengths) >= 2
    for threshold in (20, 64, 100, 1040, 2048, 5000):
        for aligned in (True, False):
            reached = {tune_bucket(n) for n in range(16, min(threshold, limit) + 1)
                       if (n % 16 == 0) == aligned}
            warmed = {tune_bucket(n) for n in lengths
                      if n <= threshold and (n % 16 == 0) == aligned}
            assert reached <= warmed, (threshold, aligned)


@pytest.mark.parametrize("max_len, budget, seqs, expected_multi", [
    (2048, 8192, 256, [[2] * 3, [2] * 16, [2048] * 4]),
    (4096, 2048, 256, [[2] * 3, [2] * 16]),       # one prompt can fill the budget
    (2048, 8192, 8, [[2] * 3, [2048] * 4]),       # no 16 prompts in a step
    (2048, 16, 256, [[2] * 3]),                    # 16 x 2 tokens exceed the budget
])
def test_prefill_warm_up_batches_stay_within_the_limits(max_len, budget, seqs, expected_multi):
    from archserve.engine.model_runner import prefill_warm_up_batches
    batches = prefill_warm_up_batches(max_len, budget, seqs)
    assert [b for b in batches if len(b) > 1] == expected_multi
    for batch in batches:
        assert len(batch) <= seqs and sum(batch) <= budget and max(batch) <= max_len
