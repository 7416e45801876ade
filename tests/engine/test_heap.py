"""What a GPU engine's start-up freezes, what gives it back (engine/heap.py), and that a
dropped engine is freed by reference counting alone, which a frozen heap needs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from archserve.engine import heap
from archserve.engine.cuda_graphs import DecodeGraphRunner


class _Node:
    other: _Node

    def forward(self, *args):  # noqa: ANN002, ANN201
        return args


def test_a_frozen_cycle_is_collected_once_released():
    a, b = _Node(), _Node()
    a.other, b.other = b, a          # a cycle: only the collector frees it
    dropped = weakref.ref(a)
    frozen_before = gc.get_freeze_count()
    heap.freeze_startup_heap("cuda")
    try:
        assert gc.get_freeze_count() > frozen_before
        del a, b
        gc.collect()
        assert dropped() is not None  # frozen: out of the collector's reach
    finally:
        heap.release_frozen()         # what the next engine's start-up does first
    assert gc.get_freeze_count() == 0 and dropped() is None


def test_freeing_dropped_engines_reaches_a_frozen_cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    dropped = weakref.ref(a)
    heap.freeze_startup_heap("cuda")
    del a, b
    heap.free_dropped_engines("cpu")   # as the bench peer and the GPU tests' fixture do
    assert gc.get_freeze_count() == 0 and dropped() is None


def test_a_cpu_engine_freezes_nothing():
    before = gc.get_freeze_count()
    heap.freeze_startup_heap("cpu")
    assert gc.get_freeze_count() == before


def test_a_graph_runner_does_not_keep_its_model_runner_alive():
    owner = _Node()
    graphs = DecodeGraphRunner(owner.forward, torch.device("cpu"), 1, 1, 16)
    owner.other = graphs             # as ModelRunner.graphs
    assert graphs.forward(1, 2) == (1, 2)
    dropped = weakref.ref(owner)
    del owner
    assert dropped() is None         # no cycle left for the collector


def _freed_without_the_collector(make_engine, check=None) -> bool:  # noqa: ANN001
    """Whether the engine ``make_engine()`` builds (``check``ed first) is freed as soon as
    its last reference goes, the collector switched off."""
    engine = make_engine()
    if check is not None:
        check(engine)
    refs = [weakref.ref(engine), weakref.ref(engine.runner), weakref.ref(engine.model)]
    gc.collect()
    gc.disable()
    try:
        del engine
        return all(ref() is None for ref in refs)
    finally:
        gc.enable()
        heap.release_frozen()


def test_a_dropped_cpu_engine_is_freed_by_reference_counting(tiny_checkpoint):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    path = tiny_checkpoint("llama")
    assert _freed_without_the_collector(
        lambda: LLMEngine(EngineConfig(model=path, max_model_len=128)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_dropped_gpu_engine_with_graphs_is_freed_by_reference_counting(tiny_checkpoint):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    # Head size 64: the plain tiny Llama's 16 is below the Triton backend's minimum, and the
    # backend that takes it reads lengths on the host, so that engine captured no graph.
    path = tiny_checkpoint("llama-h64")

    held = {}

    def frozen_with_graphs(engine) -> None:  # noqa: ANN001
        report = engine.report
        assert report.graph_sizes, (
            f"the engine captured no CUDA graph (attention {report.attention.name}; "
            f"graphs off: {report.graphs_off}; demoted: {report.graph_demoted})")
        assert gc.get_freeze_count() > 0, "start-up froze nothing"
        held["allocated"] = torch.cuda.memory_allocated()
        held["kv_and_weights"] = (
            sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
            + sum(p.numel() * p.element_size() for p in engine.model.parameters()))

    assert _freed_without_the_collector(
        lambda: LLMEngine(EngineConfig(model=path, max_model_len=128, dtype="bfloat16",
                                       kv_cache_memory_bytes=1 << 26, max_num_seqs=4)),
        frozen_with_graphs)
    # Freed by reference counting: the KV pool and the weights went back to the caching
    # allocator without a collection (what start-up caches process-wide may stay).
    freed = held["allocated"] - torch.cuda.memory_allocated()
    assert freed >= held["kv_and_weights"], (freed, held)
