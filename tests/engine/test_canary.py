"""The numerics canary demotes a wrong attention kernel before it serves a request."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from archserve import LLM, SamplingParams
from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import ENTRY_POINT_GROUP, BackendError


@pytest.fixture
def wrong_backend_first(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    registry = default_registry()
    if "WRONG_ATTN" not in registry.backends("attention"):
        registry.load_entry_points([importlib.metadata.EntryPoint(
            name="wrong", group=ENTRY_POINT_GROUP, value="wrong_attention_plugin:register")])
    original = registry._priorities["attention"]
    monkeypatch.setitem(registry._priorities, "attention",
                        lambda device, spec: ["WRONG_ATTN", *original(device, spec)])
    yield registry
    registry.unregister("attention", "WRONG_ATTN")


def test_wrong_kernel_is_demoted_with_the_reason(tiny_checkpoint, wrong_backend_first):
    llm = LLM(tiny_checkpoint("llama"))
    report = llm.llm_engine.report
    assert report.attention.name == "TORCH_SDPA"
    rejected = {r.backend: r.reason for r in report.attention.rejected}
    assert rejected["WRONG_ATTN"].startswith("numerics canary (prefill step): max error")
    assert any(line.startswith("WRONG_ATTN: numerics canary") for line in report.canary)
    assert "WRONG_ATTN" in llm.llm_engine.describe_route()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_forcing_a_wrong_kernel_is_an_error(tiny_checkpoint, wrong_backend_first):
    with pytest.raises(BackendError, match="numerics canary"):
        LLM(tiny_checkpoint("llama"), attention_backend="WRONG_ATTN")


def test_correct_kernels_pass(tiny_checkpoint):
    report = LLM(tiny_checkpoint("llama")).llm_engine.report
    assert report.canary == ["TORCH_SDPA: passed"]


def test_a_demoted_graph_size_is_described_by_what_its_batches_run():
    from archserve.engine.cuda_graphs import describe_demoted
    assert (describe_demoted([1, 2, 8], {4: "RuntimeError: x"})
            == "size 4 replays the size-8 graph (RuntimeError: x)")
    assert describe_demoted([1, 2], {4: "r"}) == "size 4 runs eager (r)"


def test_canary_checks_sinks_where_the_model_has_them():
    """A kernel that passes without sinks fails the canary of a model with them when it
    ignores them (here flex, whose rules refuse sinks, run past its rules)."""
    import torch

    from archserve.engine.canary import attention_canary
    from archserve.kernels.attention.flex_backend import FlexAttentionImpl
    from archserve.kernels.attention.sdpa_backend import SdpaAttentionImpl
    from archserve.kernels.specs import AttentionSpec

    spec = AttentionSpec(head_size=64, dtype=torch.float32, num_heads=4, num_kv_heads=2,
                         sliding_window=16)
    cpu = torch.device("cpu")
    with_sinks = AttentionSpec(**{**spec.__dict__, "has_sinks": True})
    assert attention_canary(FlexAttentionImpl(), spec, 16, cpu) is None
    assert "max error" in attention_canary(FlexAttentionImpl(), with_sinks, 16, cpu)
    assert attention_canary(SdpaAttentionImpl(), with_sinks, 16, cpu) is None
