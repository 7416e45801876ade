"""Python's cyclic garbage collector and a GPU engine's steps.

A batch-1 decode step on a GPU lasts a few ms, and with async scheduling the host launches
the next step while the device runs this one. A collection that walks what start-up built
(the model's modules, the tuners' tables, the graphs' owners: ~860,000 objects for
Qwen3-30B-A3B) stops the host for milliseconds, and the device runs dry: on an H200 one
such pause (6.8 ms) made a 2.2 ms step 8.2 ms (measured with benchmarks/step_vs_graph.py). What
start-up built lives as long as the engine, so once built it is moved out of the
collector's reach (``gc.freeze``), as vLLM does.

Frozen objects are never collected as cycles, only by reference counting. So the graph
runners hold their model runner weakly (``cuda_graphs.weak_callback``), and a dropped
engine is freed as soon as its last reference goes (tests/engine/test_heap.py; its GPU
case covers an engine with graphs captured). Should
something else tie an engine into a cycle, what is frozen goes back to the collector, and
a collection runs, before the next engine is built and in ``LLMEngine.shutdown``; the
benchmarks and tests free a dropped engine's memory through ``free_dropped_engines``. That thaws everything frozen in the
process, also what the application or another live engine froze: those become the
collector's again until the next start-up freezes them (a cost, not a fault).
"""

from __future__ import annotations

import gc

import torch


def release_frozen() -> None:
    """Give what an earlier engine froze back to the collector, and collect (nothing to do
    when nothing is frozen: CPU engines never freeze)."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap(device_type: str) -> None:
    """After start-up on a GPU: collect, then freeze every object alive (see the module
    doc). On CPU a step lasts tens of ms; nothing is frozen."""
    if device_type == "cuda":
        gc.collect()
        gc.freeze()


def free_dropped_engines(device_type: str) -> None:
    """Free what engines dropped in this process hold, before something else takes the
    device's memory (the transformers peer, the next test): the frozen heap given back,
    a collection (the runner's cycles), and on CUDA the caching allocator's free blocks."""
    gc.unfreeze()
    gc.collect()
    if device_type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
