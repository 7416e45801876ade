"""The token budget of steps with decodes, from the step cost model (engine/step_budget.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from archserve.engine.ceilings import Ceilings
from archserve.engine.step_budget import (
    BUDGET_MULTIPLE,
    DEFAULT_ITL_FACTOR,
    choose_decoding_budget,
    cost_model,
    floor_cost_model,
    measured_cost_model,
    probe_lengths,
    resolve_token_budget,
    shared_stall_budgets,
)
from archserve.engine.step_weights import StepWeights


def linear(fixed_ms: float, per_token_ms: float):
    """A cost model through points of fixed + per-token cost, like a measured device."""
    return cost_model([(n, (fixed_ms + per_token_ms * n) / 1e3) for n in probe_lengths(8192)],
                      "measured")


def test_largest_within_inverts_seconds_between_and_beyond_the_points():
    rng = random.Random(0)
    for _ in range(20):
        lengths = sorted(rng.sample(range(1, 3000), 5))
        model = cost_model([(n, rng.uniform(0.001, 0.1)) for n in lengths], "measured")
        for n in (lengths[0] + 1, lengths[2], (lengths[3] + lengths[4]) / 2, lengths[4] * 3):
            seconds = model.seconds(n)
            if seconds > model.points[-2][1]:   # unique inverse where the cost still grows
                assert model.largest_within(seconds) == pytest.approx(n, rel=1e-6)
    model = linear(5.0, 0.025)
    assert model.largest_within(0.004) == 0.0             # not even one token fits
    assert model.seconds(4096) == pytest.approx((5.0 + 0.025 * 4096) / 1e3)   # extrapolated


def test_noisy_points_never_make_more_tokens_cheaper():
    model = cost_model([(1, 0.005), (128, 0.004), (512, 0.012), (512, 0.5)], "measured")
    assert model.points == ((1, 0.005), (128, 0.005), (512, 0.012))
    assert all(model.seconds(a) <= model.seconds(b) for a, b in [(1, 64), (64, 300), (300, 900)])


def test_budget_is_the_largest_multiple_of_16_within_the_target_and_clamped():
    model = linear(5.0, 0.025)                     # 20 ms fits 600 tokens
    budget = choose_decoding_budget(model, 0.020, low=1, high=8192)
    assert budget == 592 and budget % BUDGET_MULTIPLE == 0
    assert model.seconds(budget) <= 0.020 < model.seconds(budget + BUDGET_MULTIPLE)
    assert choose_decoding_budget(model, 0.020, low=256, high=512) == 512     # the cap
    assert choose_decoding_budget(model, 0.006, low=256, high=8192) == 256    # max_num_seqs


def test_with_mixed_graphs_the_budget_drops_to_the_bucket_below():
    """A step pads up to its graph bucket: 672 tokens would replay (and cost) the 768 one."""
    model = cost_model([(1, 0.005), (512, 0.0125), (768, 0.0175), (1024, 0.022)], "measured")
    buckets = [16, 32, 64, 128, 256, 512, 768]
    assert choose_decoding_budget(model, 0.0158, low=16, high=8192) == 672
    assert choose_decoding_budget(model, 0.0158, 16, 8192, buckets) == 512
    assert choose_decoding_budget(model, 0.0175, 16, 8192, buckets) == 768   # a bucket fits
    # Past the last bucket steps run eagerly, costed between the last bucket's replay and
    # the next (eager) probe: no snapping there.
    assert choose_decoding_budget(model, 0.020, 16, 8192, buckets) == 896
    assert choose_decoding_budget(model, 0.0158, 600, 8192, buckets) == 600   # max_num_seqs
    budget = resolve_token_budget("auto", None, 8192, 16, True, lambda: model, buckets)
    assert budget.decoding == 512 and "a CUDA graph bucket" in budget.decision.reason


def test_a_slower_cost_model_gives_a_smaller_budget():
    fast, slow = linear(5.0, 0.025), linear(5.0, 0.05)   # same decode step, dearer tokens
    for target in ("auto", 30.0):
        budgets = [resolve_token_budget(target, None, 8192, 16, True, lambda m=m: m).decoding
                   for m in (fast, slow)]
        assert budgets[1] < budgets[0], (target, budgets)
    auto = resolve_token_budget("auto", None, 8192, 16, True, lambda: fast)
    target_s = DEFAULT_ITL_FACTOR * fast.seconds(16)     # a 16-sequence decode step
    assert fast.seconds(auto.decoding) <= target_s < fast.seconds(auto.decoding + 16)
    assert auto.max_num_batched_tokens == 8192     # a step without decodes fills the cap
    assert str(auto.decoding) in auto.decision.chosen and "measured" in auto.decision.reason


def test_sixteen_running_streams_leave_room_for_prompt_tokens():
    """A CPU-like step whose cost grows with every row (16.5 ms + 1.3 ms a token): the auto
    target is 3x a 16-sequence decode step, so 16 running streams still let prompts in,
    several tokens a step, instead of one token a step beside them. A GPU-like step (the
    weights' read dominates up to hundreds of rows) keeps 3x a one-token step."""
    cpu = linear(16.5, 1.3)
    auto = resolve_token_budget("auto", None, 8192, 16, True, lambda: cpu)
    assert auto.decoding >= 3 * 16, auto.decision.reason
    assert cpu.seconds(auto.decoding) <= auto.target_itl_s == DEFAULT_ITL_FACTOR * cpu.seconds(16)
    assert "a decode step of 16 sequences" in auto.decision.reason
    few = resolve_token_budget("auto", None, 8192, 4, True, lambda: cpu)
    assert few.target_itl_s == DEFAULT_ITL_FACTOR * cpu.seconds(4)    # never past max_num_seqs
    gpu = linear(5.0, 0.0005)
    served = resolve_token_budget("auto", None, 8192, 256, True, lambda: gpu)
    assert served.target_itl_s == pytest.approx(DEFAULT_ITL_FACTOR * gpu.seconds(1), rel=0.01)


def test_fewer_decoding_streams_share_a_longer_stall_on_a_cpu():
    """A CPU-like step (11.5 ms + 0.75 ms a token, as the embedded model measures): with 16
    streams decoding the budget fits the target; with R < 16 a step may stall each of them
    longer, R x (step - their decode step) within 16 x (target - a 16-sequence step), so one
    running stream lets a burst of short prompts in at once. Without sharing (a GPU's
    default) the budget stays one number."""
    cpu = linear(11.5, 0.75)
    shared = resolve_token_budget("auto", None, 8192, 16, True, lambda: cpu, share_stall=True)
    assert shared.decoding == resolve_token_budget("auto", None, 8192, 16, True,
                                                   lambda: cpu).decoding
    by_streams = shared.decoding_by_streams
    assert len(by_streams) == 15 and by_streams[0] >= 10 * shared.decoding
    assert list(by_streams) == sorted(by_streams, reverse=True)
    assert all(b >= shared.decoding and b % BUDGET_MULTIPLE == 0 for b in by_streams)
    slack = 16 * (shared.target_itl_s - cpu.seconds(16))
    for r, budget in enumerate(by_streams, start=1):
        assert r * (cpu.seconds(budget) - cpu.seconds(r)) <= slack + 1e-12
        if budget > shared.decoding:     # the largest such budget (rounded to 16)
            assert r * (cpu.seconds(budget + BUDGET_MULTIPLE) - cpu.seconds(r)) > slack
    assert "1 decoding" in shared.decision.reason and f"{by_streams[0]} with 1" in \
        shared.decision.chosen
    assert shared.to_json()["decoding_token_budget_by_streams"] == list(by_streams)
    assert resolve_token_budget("auto", None, 8192, 16, True, lambda: cpu).decoding_by_streams == ()
    # Never past the cap, and max_num_seqs below 16 anchors the sharing there.
    assert shared_stall_budgets(cpu, shared.target_itl_s, 16, 48, 256)[0] == 256
    few = resolve_token_budget("auto", None, 8192, 4, True, lambda: cpu, share_stall=True)
    assert len(few.decoding_by_streams) == 3


def test_unbounded_cases_keep_one_budget_and_do_not_build_a_cost_model():
    def no_model():
        raise AssertionError("no cost model is needed here")

    explicit = resolve_token_budget("auto", 512, 512, 256, True, no_model)
    assert (explicit.decoding, explicit.max_num_batched_tokens) == (512, 512)
    assert "vLLM" in explicit.decision.reason
    offline = resolve_token_budget(None, None, 8192, 256, True, no_model)
    assert offline.decoding == 8192
    whole = resolve_token_budget("auto", None, 8192, 256, False, no_model)
    assert whole.decoding == 8192 and "chunked prefill is off" in whole.decision.reason


def test_floor_model_of_a_slower_device_gives_a_smaller_budget():
    # Llama-3-8B-like weights: 7e9 body parameters in bf16, a 128256 x 4096 head.
    weights = StepWeights(7_000_000_000, 14_000_000_000, 525_336_576, 1_050_673_152)
    h200 = Ceilings(789e12, 4.15e12, "h200-like", "bfloat16")
    lengths = probe_lengths(8192)
    fast = floor_cost_model(weights, h200, lengths)
    # The floor is memory-bound for one token and compute-bound for long chunks.
    assert fast.seconds(1) == pytest.approx(15.05e9 / 4.15e12, rel=0.01)
    assert fast.seconds(2048) == pytest.approx(2 * 7e9 * 2048 / 789e12, rel=0.01)
    slow = floor_cost_model(weights, dataclasses.replace(h200, matmul_flops_per_s=300e12),
                            lengths)
    budgets = [choose_decoding_budget(m, 0.020, 16, 8192) for m in (fast, slow)]
    assert budgets[1] < budgets[0]


def test_measured_model_times_real_steps_of_the_tiny_model(tiny_checkpoint):
    """On the CPU: the runner's probe step through the measuring path, and the engine
    reporting the budget it chose."""
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_checkpoint("llama"), target_itl_ms=10_000.0,
                                    max_num_seqs=4, max_model_len=128))
    model = measured_cost_model(engine.runner.run_prefill_probe, [1, 8], engine.runner.device,
                                repeats=1)
    assert [n for n, _ in model.points] == [1, 8] and 0 < model.seconds(1) <= model.seconds(8)
    decision = next(d for d in engine.report.decisions if d.what == "max_num_batched_tokens")
    # A CPU times its own short steps (the roofline floors miss its per-step overhead).
    assert "target ITL 1e+04 ms" in decision.reason and "(measured)" in decision.reason
    budget = engine.report.token_budget
    assert [n for n, _ in budget.cost.points] == [1, 16, 64] and budget.cost.seconds(1) > 0
    config = engine.scheduler.config
    # The stall shared below max_num_seqs streams, as the scheduler applies it.
    assert len(config.decoding_token_budget_by_streams) == 3
    assert config.budget_with_decodes(1) == budget.decoding_by_streams[0]
    assert config.decoding_token_budget is not None
    assert 4 <= config.decoding_token_budget <= config.max_num_batched_tokens
    assert f"{config.decoding_token_budget} with decodes" in decision.chosen
    budget = engine.report.token_budget.to_json()
    assert budget["decoding_token_budget"] == config.decoding_token_budget
    assert budget["cost_source"] == "measured" and budget["target_itl_s"] == 10.0


@pytest.mark.gpu
def test_gpu_budget_is_measured_after_warm_up_and_long_prompts_finish(tiny_checkpoint):
    from archserve import LLM, SamplingParams

    llm = LLM(tiny_checkpoint("llama-h64"), dtype="bfloat16", target_itl_ms="auto",
              max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    engine = llm.llm_engine
    budget = engine.report.token_budget
    assert budget.cost.source == "measured", budget.to_json()
    # The tiny model's context is 256 tokens: the probes stop there.
    assert [n for n, _ in budget.cost.points] == [1, 128, 256], budget.to_json()
    assert 0 < budget.cost.seconds(1) <= budget.cost.seconds(256), budget.to_json()
    cap = engine.scheduler.config.max_num_batched_tokens
    assert 8 <= budget.decoding <= cap, budget.to_json()
    assert budget.decoding % 16 == 0 or budget.decoding < 16, budget.to_json()
    assert engine.scheduler.config.budget_while_decoding == budget.decoding
    assert budget.decoding == cap or budget.cost.seconds(budget.decoding) <= budget.target_itl_s
    # Short prompts decode while a long one is prefilled beside them.
    prompts = [[5 + i] * 8 for i in range(4)] + [[7] * 200]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 5
