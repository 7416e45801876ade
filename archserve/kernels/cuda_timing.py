"""Kernel timing with CUDA events: warm-up, then the median of timed runs.

``graph_median_us`` times a CUDA graph of several calls, which is what the engine replays;
timed eagerly, a kernel of a few microseconds would measure Python and launch overhead.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def mean_ms(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Mean ms per call of ``iters`` calls back to back (one event pair around them all:
    launches queue up as they would in a loop, so a short call is not timed alone)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def graph_median_us(run: Callable[[], object], iters: int, warmup: int = 3, reps: int = 20
                    ) -> tuple[float, str]:
    """Median µs per call: a graph of ``reps`` calls when capture works, else eager."""
    for _ in range(warmup):  # also compiles Triton kernels before any capture
        run()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                run()
        graph.replay()
        torch.cuda.synchronize()
        return 1e3 * median_ms(graph.replay, iters) / reps, "graph"
    except Exception as exc:  # noqa: BLE001 - the caller records the fallback
        print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly",
              file=sys.stderr)
        torch.cuda.synchronize()
        return 1e3 * median_ms(run, iters), "eager"
