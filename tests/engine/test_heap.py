"""What a GPU engine's start-up freezes, and what gives it back (engine/heap.py)."""

from __future__ import annotations

import gc
import weakref

from archserve.engine import heap


class _Node:
    other: _Node


def test_a_frozen_cycle_is_collected_once_released():
    a, b = _Node(), _Node()
    a.other, b.other = b, a          # as a runner and its graphs: only the collector frees it
    dropped = weakref.ref(a)
    heap.freeze_startup_heap("cuda")
    try:
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert dropped() is not None  # frozen: out of the collector's reach
    finally:
        heap.release_frozen()         # what the next engine's start-up does first
    assert gc.get_freeze_count() == 0 and dropped() is None


def test_a_cpu_engine_freezes_nothing():
    heap.freeze_startup_heap("cpu")
    assert gc.get_freeze_count() == 0
