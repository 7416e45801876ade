"""Kernel timing with CUDA events: warm-up, then the median of timed runs."""

from __future__ import annotations

import statistics
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
