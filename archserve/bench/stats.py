"""Percentiles and latency summaries, written out so the arithmetic is testable."""

from __future__ import annotations

import math

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | int]:
    """Mean and P50/P90/P99 in the units given, plus the sample count."""
    summary: dict[str, float | int] = {
        "count": len(values),
        "mean": sum(values) / len(values) if values else math.nan,
    }
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(values, q)
    return summary


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan
