"""The bench's arithmetic on hand-computed cases: percentiles, rates, roofline, MBU,
workload generation, arrivals and metrics parsing. No engine, no timing."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from archserve.bench.offline import ThroughputResult
from archserve.bench.roofline import (
    ModelFacts,
    analyze,
    attended_pairs,
    step_bytes,
    step_floor_seconds,
    step_flops,
)
from archserve.bench.server_metrics import parse_metrics, sample_from
from archserve.bench.serving import RequestTiming, arrival_gaps
from archserve.bench.stats import percentile, summarize
from archserve.bench.step_trace import ScheduledWork, StepRecord, StepTrace
from archserve.bench.workload import dataset_requests, length_range, random_requests
from archserve.engine.ceilings import Ceilings, load_or_measure

FACTS = ModelFacts(body_params=1000, lm_head_params=200, weight_bytes=2400, num_layers=2,
                   num_heads=4, head_dim=8, kv_bytes_per_token_per_layer=64)
CEILINGS = Ceilings(matmul_flops_per_s=1e6, copy_bytes_per_s=1e5, device_name="test",
                    matmul_dtype="float32")


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]            # sorted: 1 2 3 4
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)   # rank 2.7: 3 + 0.7
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert math.isnan(percentile([], 50))
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["count"] == 4 and s["mean"] == pytest.approx(2.5) and s["p90"] == pytest.approx(3.7)


def test_throughput_is_tokens_over_elapsed():
    r = ThroughputResult(num_requests=4, prompt_tokens=300, output_tokens=100, elapsed_s=2.0)
    assert r.output_tokens_per_s == 50.0
    assert r.total_tokens_per_s == 200.0
    assert r.requests_per_s == 2.0


def test_tpot_is_decode_time_over_tokens_after_the_first():
    t = RequestTiming(prompt_tokens=5, output_tokens=11, ttft_s=0.5, e2e_s=1.5)
    assert t.tpot_s == pytest.approx(0.1)
    assert RequestTiming(prompt_tokens=5, output_tokens=1, ttft_s=0.5, e2e_s=0.5).tpot_s is None


def test_attended_pairs_counts_causal_prefill_and_decode():
    assert attended_pairs(1, 9) == 10          # a decode sees the 9 cached tokens and itself
    assert attended_pairs(4, 0) == 10          # 1 + 2 + 3 + 4
    assert attended_pairs(3, 5) == 3 * 5 + 6   # chunk after a cached prefix


def test_roofline_floor_of_a_hand_computed_two_step_run():
    prefill = [ScheduledWork(num_new_tokens=4, context_len=0, samples=True)]
    decode = [ScheduledWork(1, 4, True), ScheduledWork(1, 10, True)]
    # prefill: 2*1000*4 + 2*200*1 + layers 2 * 4*8*4 * pairs 10 = 8000 + 400 + 2560
    assert step_flops(FACTS, prefill) == 10960
    # bytes: weights 2400 + 2 layers * 64 * (0 read + 4 written) = 2912
    assert step_bytes(FACTS, prefill) == 2912
    # decode: 2*1000*2 + 2*200*2 + 2*4*8*4 * (5 + 11) = 4000 + 800 + 4096
    assert step_flops(FACTS, decode) == 8896
    # bytes: 2400 + 2 * 64 * (4 + 1 + 10 + 1) = 2400 + 2048
    assert step_bytes(FACTS, decode) == 4448
    # prefill: compute 10960/1e6 = 10.96 ms vs memory 29.12 ms -> memory bound
    assert step_floor_seconds(FACTS, prefill, CEILINGS) == pytest.approx(0.02912)
    fast_memory = Ceilings(1e6, 1e8, "test", "float32")
    assert step_floor_seconds(FACTS, prefill, fast_memory) == pytest.approx(0.01096)

    trace = StepTrace([StepRecord(prefill, 0.1), StepRecord(decode, 0.2)])
    report = analyze(trace, FACTS, CEILINGS)
    floor = 0.02912 + 0.04448
    assert report.floor_s == pytest.approx(floor)
    assert report.measured_s == pytest.approx(0.3)
    assert report.roofline_efficiency == pytest.approx(floor / 0.3)
    assert report.num_decode_steps == 1 and report.compute_bound_steps == 0
    # MBU over decode steps: 4448 bytes in 0.2 s against 1e5 B/s
    assert report.mbu == pytest.approx(4448 / 0.2 / 1e5)
    assert report.decode_step_s_mean == pytest.approx(0.2)
    assert report.decode_floor_s_mean == pytest.approx(0.04448)
    assert report.total_flops == 10960 + 8896


def test_a_run_faster_than_its_ceilings_measures_again_then_raises_them():
    """Ceilings measured on a busy machine come out low: a run that beats them measures
    them again; if it still beats the new ones, they are raised to what it reached, so
    efficiency and MBU never exceed 100%."""
    from archserve.bench.roofline import analyze_within_ceilings
    decode = [ScheduledWork(1, 4, True), ScheduledWork(1, 10, True)]
    trace = StepTrace([StepRecord(decode, 0.01)])        # 4448 B in 10 ms: 4.4e5 B/s
    assert analyze(trace, FACTS, CEILINGS).mbu > 1       # a stale entry: 1e5 B/s
    calls = []

    def remeasure(rate: float):
        def again():
            calls.append(rate)
            return Ceilings(1e7, rate, "test", "float32", measured_at="now")
        return again
    report, used = analyze_within_ceilings(trace, FACTS, CEILINGS, remeasure(1e6))
    assert calls == [1e6] and used.copy_bytes_per_s == 1e6 and used.raised_by_run == 1
    assert report.mbu == pytest.approx(4448 / 0.01 / 1e6)
    report, used = analyze_within_ceilings(trace, FACTS, CEILINGS, remeasure(2e5))
    assert report.mbu == pytest.approx(1.0) and report.roofline_efficiency <= 1 + 1e-9
    assert used.raised_by_run == pytest.approx(4448 / 0.01 / 2e5)
    assert "raised" in used.describe() and "measured now" in used.describe()
    calls.clear()
    report, used = analyze_within_ceilings(trace, FACTS, Ceilings(1e9, 1e9, "t", "f"),
                                           remeasure(1.0))
    assert not calls and used.raised_by_run == 1         # within its ceilings: as it was


def test_mbu_is_null_without_decode_steps():
    trace = StepTrace([StepRecord([ScheduledWork(8, 0, True)], 0.05)])
    assert analyze(trace, FACTS, CEILINGS).to_json()["mbu"] is None


def test_random_requests_are_seeded_in_range_and_avoid_special_tokens():
    special = {0, 1, 2}
    a = random_requests(50, 20, 10, vocab_size=40, special_token_ids=special,
                        range_ratio=0.5, seed=7)
    b = random_requests(50, 20, 10, vocab_size=40, special_token_ids=special,
                        range_ratio=0.5, seed=7)
    assert a == b
    assert a != random_requests(50, 20, 10, 40, special, 0.5, seed=8)
    assert all(10 <= r.input_len <= 30 and 5 <= r.output_len <= 15 for r in a)
    assert len({r.input_len for r in a}) > 3       # the range is used
    assert not special & {t for r in a for t in r.prompt_token_ids}
    fixed = random_requests(5, 12, 3, vocab_size=40, seed=0)
    assert {(r.input_len, r.output_len) for r in fixed} == {(12, 3)}
    assert length_range(100, 0.1) == (90, 110)
    with pytest.raises(ValueError):
        length_range(10, 1.5)


class _SplitTokenizer:
    def encode(self, text):
        return [len(w) for w in text.split()]


def test_dataset_requests_from_json(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["a bb ccc", {"prompt": [5, 6], "output_len": 3},
                                {"prompt": "dddd"}]))
    reqs = dataset_requests(str(path), _SplitTokenizer(), output_len=9)
    assert [(r.prompt_token_ids, r.output_len) for r in reqs] == [
        ([1, 2, 3], 9), ([5, 6], 3), ([4], 9)]
    assert len(dataset_requests(str(path), _SplitTokenizer(), 9, num_prompts=2)) == 2
    path.write_text(json.dumps([{"text": "no prompt key"}]))
    with pytest.raises(ValueError, match="item 0"):
        dataset_requests(str(path), _SplitTokenizer(), 9)


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    gaps = arrival_gaps(4000, request_rate=20.0, seed=3)
    assert gaps == arrival_gaps(4000, 20.0, seed=3)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.08)
    assert arrival_gaps(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, seed=0)


def test_metrics_parsing_reads_archserve_and_vllm_names():
    text = ("# TYPE archserve:kv_cache_usage_perc gauge\narchserve:kv_cache_usage_perc 0.25\n"
            "# TYPE archserve:num_requests_running gauge\narchserve:num_requests_running 3\n"
            "# TYPE archserve:device_memory_used_bytes gauge\n"
            'archserve:device_memory_used_bytes{device="cuda:0"} 1024\n')
    s = sample_from(parse_metrics(text), t=1.5)
    assert (s.t, s.kv_cache_usage, s.num_running, s.memory_used_bytes) == (1.5, 0.25, 3, 1024)
    assert s.memory_peak_bytes is None
    vllm = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
    assert sample_from(parse_metrics(vllm), 0.0).kv_cache_usage == 0.5
    # archserve exports vLLM's names beside its own: the same figure is not counted twice
    both = text + ('# TYPE vllm:kv_cache_usage_perc gauge\n'
                   'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert sample_from(parse_metrics(both), 0.0).kv_cache_usage == 0.25


def test_calibration_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path))
    import torch
    first = load_or_measure(torch.device("cpu"))
    assert not first.cached
    assert first.matmul_flops_per_s > 1e6 and first.copy_bytes_per_s > 1e6
    files = list((tmp_path / "calibration").glob("cpu-*.json"))
    assert len(files) == 1
    second = load_or_measure(torch.device("cpu"))
    assert second.cached
    assert second.matmul_flops_per_s == first.matmul_flops_per_s
    assert second.measured_at == first.measured_at and first.measured_at.endswith("Z")
    assert "cached, measured " + first.measured_at in second.describe()
    files[0].write_text("not json")              # a corrupt entry is measured again
    assert not load_or_measure(torch.device("cpu")).cached


def test_the_calibration_key_retires_entries_of_another_method(tmp_path, monkeypatch):
    import torch

    from archserve.engine import ceilings
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path))
    path = ceilings.cache_path(torch.device("cpu"))
    monkeypatch.setattr(ceilings, "CALIBRATION_VERSION", ceilings.CALIBRATION_VERSION + 1)
    assert ceilings.cache_path(torch.device("cpu")) != path


def test_moe_steps_read_the_experts_their_tokens_touch():
    """8 experts of 100 bytes (top-2) beside 1000 dense bytes: one token reads 2 experts,
    a large batch all 8; FLOPs count the 2 experts each token multiplies."""
    from archserve.engine.step_weights import experts_touched
    moe = ModelFacts(body_params=500, lm_head_params=0, weight_bytes=1000, num_layers=1,
                     num_heads=1, head_dim=1, kv_bytes_per_token_per_layer=0,
                     expert_params=400, expert_bytes=800, num_experts=8, top_k=2)
    one = [ScheduledWork(num_new_tokens=1, context_len=0, samples=False)]
    assert step_bytes(moe, one) == 1000 + 2 * 100
    many = [ScheduledWork(num_new_tokens=1, context_len=0, samples=False)] * 64
    assert step_bytes(moe, many) == pytest.approx(1000 + 800 * (1 - 0.75 ** 64))
    assert step_flops(moe, one) == 2 * (500 + 400 * 2 / 8) + 4     # + attention: 4 * 1 pair
    assert experts_touched(2, 8, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert experts_touched(5, 0, 0) == 0.0


def test_budget_tradeoff_plot_draws_every_budget(tmp_path):
    from archserve.bench.plots import budget_tradeoff
    points = [{"label": "512", "ttft_p50_ms": 40.0, "itl_p99_ms": 20.0},
              {"label": "2048", "ttft_p50_ms": 30.0, "itl_p99_ms": 60.0},
              {"label": "auto", "ttft_p50_ms": 35.0, "itl_p99_ms": 25.0}]
    path = budget_tradeoff(points, str(tmp_path / "tradeoff.png"), "16 req/s")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
