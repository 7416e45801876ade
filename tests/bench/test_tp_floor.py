"""The tensor-parallel decode floor on hand-computed cases, and tp_perf's arguments."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from archserve.bench.roofline import ModelFacts
from archserve.bench.step_trace import ScheduledWork, StepRecord, StepTrace
from archserve.bench.tp_floor import allreduce_seconds, mean_decode_floor
from archserve.engine.ceilings import Ceilings

TABLE = [{"bytes": 16384, "nccl_graph_us": 22.0, "one_shot_us": 9.0},
         {"bytes": 8192, "nccl_graph_us": 20.0, "one_shot_us": 8.0},
         {"bytes": 4 << 20, "nccl_graph_us": 60.0, "one_shot_us": None}]
FACTS = ModelFacts(body_params=1000, lm_head_params=200, weight_bytes=2400, num_layers=2,
                   num_heads=4, head_dim=8, kv_bytes_per_token_per_layer=64)
CEILINGS = Ceilings(matmul_flops_per_s=1e6, copy_bytes_per_s=1e5, device_name="test",
                    matmul_dtype="bfloat16")


def test_an_all_reduce_takes_the_faster_path_at_the_smallest_size_that_holds_it():
    assert allreduce_seconds(TABLE, 8192) == pytest.approx(8e-6)
    assert allreduce_seconds(TABLE, 8193) == pytest.approx(9e-6)     # rounded up to 16 KiB
    assert allreduce_seconds(TABLE, 3 << 20) == pytest.approx(60e-6)  # past the one-shot
    with pytest.raises(ValueError, match="no all-reduce was measured at 8388608 bytes"):
        allreduce_seconds(TABLE, 8 << 20)


def test_the_decode_floor_is_one_ranks_bytes_plus_two_all_reduces_per_layer():
    prefill = StepRecord([ScheduledWork(10, 0, True)], 1.0)           # not a decode step
    one = StepRecord([ScheduledWork(1, 9, True)], 0.05)
    two = StepRecord([ScheduledWork(1, 9, True), ScheduledWork(1, 19, True)], 0.08)
    trace = StepTrace([prefill, one, two])
    # Bytes: weights 2400 + 2 layers x 64 x tokens in the cache (10; 10 + 20), over
    # 1e5 B/s; their FLOPs take less. Messages of 4096 x 2 bytes per token: 8 KiB at
    # batch 1 (8 us), 16 KiB at batch 2 (9 us), 2 per layer on 2 layers.
    memory, reduce = mean_decode_floor(trace, FACTS, CEILINGS, TABLE, hidden_size=4096,
                                       dtype_bytes=2)
    assert memory == pytest.approx((3680 / 1e5 + 6240 / 1e5) / 2)
    assert reduce == pytest.approx((4 * 8e-6 + 4 * 9e-6) / 2)
    assert mean_decode_floor(trace, FACTS, CEILINGS, None, 4096, 2)[1] == 0.0   # one rank
    with pytest.raises(ValueError, match="no decode step"):
        mean_decode_floor(StepTrace([prefill]), FACTS, CEILINGS, TABLE, 4096, 2)


def _tp_perf():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_perf.py"
    spec = importlib.util.spec_from_file_location("tp_perf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp_perf_takes_a_model_and_tp_sizes():
    tp_perf = _tp_perf()
    args = tp_perf.build_parser().parse_args(
        ["engine", "--model", "benchmarks/models/llama-3-70b", "--tp", "4", "8"])
    assert args.tp == [4, 8] and args.model.endswith("llama-3-70b")
    assert (args.b1, args.throughput) == ((1, 128, 512), (256, 256, 128))
    assert tp_perf.build_parser().parse_args(["engine"]).tp == [1, 2]     # TP=1 against TP=2
    with pytest.raises(argparse.ArgumentTypeError):
        tp_perf.workload("256x256")
    # One token's message of the 70B shape (16 KiB) up to 256 tokens' (4 MiB).
    assert tp_perf.decode_message_sizes(8192, 256) == [1 << k for k in range(14, 23)]
    assert tp_perf.decode_message_sizes(4096, 1) == [8192]
