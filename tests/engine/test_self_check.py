"""The roofline self-check: its floor counts the bytes a decode step reads, a deliberately
slow route is flagged and named, and the result reaches `prepare --json` and /metrics."""

from __future__ import annotations

import time

import pytest

from archserve import LLM
from archserve.engine.ceilings import load_or_measure
from archserve.kernels.attention.reference import ReferenceAttentionImpl
from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import Backend


@pytest.mark.parametrize("variant", ["llama", "qwen2"])    # untied, tied
def test_floor_reads_the_lm_head_and_one_embedding_row_not_the_table(tiny_checkpoint, variant):
    llm = LLM(tiny_checkpoint(variant), dtype="float32", self_check=True)
    engine = llm.llm_engine
    check = engine.report.self_check
    model, mc = engine.model, engine.model_config
    every_weight = sum(p.numel() * p.element_size() for p in model.parameters())
    table = mc.vocab_size * mc.hidden_size * 4
    # Tied: the table is the LM head, read once; untied: the table is a row gather.
    expected = every_weight if mc.tie_word_embeddings else every_weight - table
    bandwidth = load_or_measure(engine.runner.device).copy_bytes_per_s
    assert check.floor_ms == pytest.approx(expected / bandwidth * 1e3, rel=1e-9)
    assert check.step_ms > 0 and check.time_by_kind


class SlowAttentionImpl(ReferenceAttentionImpl):
    """Correct attention that sleeps 20 ms per call: a route far off its floor."""

    def forward(self, *args, **kwargs):
        time.sleep(0.02)
        return super().forward(*args, **kwargs)


class SlowAttention(Backend):
    name = "SLOW_ATTN"
    op = "attention"
    description = "a plug-in that is correct and slow"

    def make_impl(self, device, spec):
        return SlowAttentionImpl(device, spec)


@pytest.fixture
def slow_attention():
    registry = default_registry()
    registry.register(SlowAttention())
    yield
    registry.unregister("attention", "SLOW_ATTN")


def test_a_deliberately_slow_route_is_flagged_and_named(tiny_checkpoint, slow_attention):
    slow = LLM(tiny_checkpoint("llama"), dtype="float32", self_check=True,
               attention_backend="SLOW_ATTN")
    check = slow.llm_engine.report.self_check
    assert check.flagged and check.slowest_kind == "attention", check.to_json()
    # The step it timed ran the route: each layer's attention slept 20 ms. (A comparison
    # with a fast engine's ratio breaks on a loaded machine, where that step is slow too.)
    layers = slow.llm_engine.model_config.num_layers
    assert check.step_ms >= 20 * layers, check.to_json()
    assert check.to_json()["flagged"] is True


def test_self_check_reaches_the_metrics(tiny_checkpoint):
    from prometheus_client import generate_latest

    from archserve.serve.metrics import ServerMetrics
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", self_check=True)
    text = generate_latest(ServerMetrics(llm.llm_engine).registry).decode()
    ratio = llm.llm_engine.report.self_check.ratio
    line = next(x for x in text.splitlines()
                if x.startswith("archserve:roofline_self_check_ratio "))
    assert float(line.split()[1]) == pytest.approx(ratio)
    assert "archserve:roofline_self_check_flagged " in text



@pytest.mark.gpu
def test_gpu_kernel_profile_by_op_kind_is_taken_when_asked(tiny_checkpoint):
    """self_check_profile splits the eager step's CUDA kernel time by op kind (as `prepare`
    shows it); the default start-up leaves the CUDA profiler, and CUPTI, out."""
    llm = LLM(tiny_checkpoint("llama-h64"), dtype="bfloat16", self_check_profile=True,
              gpu_memory_utilization=0.2)
    check = llm.llm_engine.report.self_check
    assert set(check.time_by_kind) >= {"attention", "linear"}, check.to_json()
    assert abs(sum(check.time_by_kind.values()) - 1.0) < 1e-6


def test_a_launch_bound_gpu_step_is_not_flagged():
    """A GPU step whose bytes take microseconds is its launches' time on any route (the
    emulated runs' tiny models: 0.2 ms against a 0.001 ms floor): said, not warned of."""
    from archserve.engine.self_check import LAUNCH_BOUND_FLOOR_MS, SelfCheck
    tiny = SelfCheck(0.217, 0.001, 0.001 / 0.217, {}, True, launch_bound=True)
    assert not tiny.flagged and "launch-bound" in tiny.summary()
    assert tiny.to_json()["launch_bound"] is True
    slow = SelfCheck(4.0, 2 * LAUNCH_BOUND_FLOOR_MS, 0.125, {}, True)
    assert slow.flagged and "launch-bound" not in slow.summary()
