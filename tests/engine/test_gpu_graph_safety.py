"""CUDA-graph safety nets on a GPU: the replay canary catches a kernel that bakes a host
value into its capture, and a size whose capture fails is demoted alone (its batches
replay the next larger graph and give the eager result)."""

from __future__ import annotations

import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.kernels.attention.triton_backend import TritonAttentionImpl
from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import Backend

pytestmark = pytest.mark.gpu


class StaleLengthImpl(TritonAttentionImpl):
    """Correct when run eagerly, wrong when replayed: it folds a host value (the shortest
    sequence length of the batch) into device math. Eagerly the clamp changes nothing; a
    graph bakes the capture's lengths (the longest possible) and replays them."""

    def forward(self, query, key, value, kv_cache, meta, layer, k_scale=1.0, v_scale=1.0):
        if meta.max_query_len == 1 and meta.seq_lens_cpu:
            meta.seq_lens = torch.clamp(meta.seq_lens, min=min(meta.seq_lens_cpu))
        return super().forward(query, key, value, kv_cache, meta, layer, k_scale, v_scale)


class FailsCapturingFour(TritonAttentionImpl):
    """Correct, but its capture at batch size 4 raises."""

    def forward(self, query, key, value, kv_cache, meta, layer, k_scale=1.0, v_scale=1.0):
        if torch.cuda.is_current_stream_capturing() and meta.num_seqs == 4:
            raise RuntimeError("injected capture failure")
        return super().forward(query, key, value, kv_cache, meta, layer, k_scale, v_scale)


def _plugin(name: str, impl):
    class Plugin(Backend):
        op = "attention"
        description = "a test plug-in"
        graph_capturable = True

        def make_impl(self, device, spec):
            return impl(device, spec)

    Plugin.name = name
    return Plugin()


@pytest.fixture
def plugins():
    registry = default_registry()
    names = {"STALE_ATTN": StaleLengthImpl, "FAILS_AT_4": FailsCapturingFour,
             "PLAIN_TRITON": TritonAttentionImpl}
    for name, impl in names.items():
        registry.register(_plugin(name, impl))
    yield
    for name in names:
        registry.unregister("attention", name)


def test_replay_canary_catches_a_baked_host_value(tiny_checkpoint, plugins):
    llm = LLM(tiny_checkpoint("llama"), dtype="bfloat16", attention_backend="STALE_ATTN",
              kv_cache_memory_bytes=1 << 28, max_num_seqs=8, self_check=False)
    report = llm.llm_engine.report
    assert not report.graph_sizes
    assert all(r.startswith("graph replay canary") for r in report.graph_demoted.values())


def test_one_failed_capture_demotes_that_size_alone(tiny_checkpoint, plugins):
    # float32: the replayed size-8 graph and the eager 4-row steps run other kernels (GEMMs
    # of 8 rows and of 4, the attention split for other batch sizes), and in bf16 this
    # model's greedy steps are as close as one ulp (top-2 log-probs 0.0078 apart, measured
    # on the CPU), where a last-bit difference picks the other token; float32's closest
    # are 0.0067 apart.
    kwargs = dict(dtype="float32", attention_backend="FAILS_AT_4",
                  kv_cache_memory_bytes=1 << 28, max_num_seqs=8, self_check=False)
    llm = LLM(tiny_checkpoint("llama"), **kwargs)
    report = llm.llm_engine.report
    assert report.graph_demoted == {4: "RuntimeError: injected capture failure"}
    assert 8 in report.graph_sizes and 4 not in report.graph_sizes
    assert llm.llm_engine.runner.graphs.size_for(4) == 8       # the next larger graph
    assert "size 4 replays the size-8 graph" in llm.llm_engine.describe_route()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(4)]
    graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eager = LLM(tiny_checkpoint("llama"), enforce_eager=True, **kwargs)
    assert graphs == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_the_canary_leaves_a_live_cache_as_it_found_it(tiny_checkpoint, plugins):
    """Graphs can be captured mid-run (calculate_kv_scales captures after the first
    prefill): the canary's random KV blocks must not overwrite live sequences' KV."""
    llm = LLM(tiny_checkpoint("llama"), dtype="bfloat16", attention_backend="PLAIN_TRITON",
              kv_cache_memory_bytes=1 << 28, max_num_seqs=8, self_check=False)
    runner = llm.llm_engine.runner
    generator = torch.Generator(device="cuda").manual_seed(1)
    for kv in runner.kv_caches:
        kv.copy_(torch.randn(kv.shape, generator=generator, device="cuda"))
    before = [kv.clone() for kv in runner.kv_caches]
    assert runner.graphs.replay_canary(runner.kv_caches) is None
    for kv, old in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(kv, old)
