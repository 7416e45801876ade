"""Named phases of an engine step, visible in a torch.profiler trace as ``archserve::NAME``.

Free when no profiler runs (one C-level flag check), so the step loop always carries them;
benchmarks/profile_engine_step.py reads them to split a step into host and device parts.
Inside ``collect_phase_times()`` each phase's host time is also summed with a clock, without
a profiler: the bench's step trace (bench/step_trace.py) reports host time per step from it.
A profiler's own cost per op inflates the host phases it sees (a batch-1 decode step's
phases took ~1.05 ms under it on an H200), so the clock is the measure of host time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from archserve.models.layers.forward_context import profiled_region

PREFIX = "archserve::"
# The host waiting for the device (a step's tokens, or a tensor-parallel step's ranks): the
# part of a step that is not host work.
WAIT_FOR_DEVICE = "wait_for_device"
_totals: dict[str, float] | None = None   # seconds per phase, inside collect_phase_times


class _TimedPhase:
    """A phase inside ``collect_phase_times``: its profiler region, and its clock time."""

    __slots__ = ("name", "region", "start")

    def __init__(self, name: str) -> None:
        self.name = name
        self.region = profiled_region(PREFIX + name)

    def __enter__(self) -> None:
        self.region.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        seconds = time.perf_counter() - self.start
        self.region.__exit__(*exc)
        if _totals is not None:
            _totals[self.name] = _totals.get(self.name, 0.0) + seconds


def phase(name: str):
    """Context manager marking ``name`` in a running profile (a no-op otherwise), and timing
    it inside ``collect_phase_times``."""
    if _totals is not None:
        return _TimedPhase(name)
    return profiled_region(PREFIX + name)


@contextlib.contextmanager
def collect_phase_times() -> Iterator[dict[str, float]]:
    """Yields a dict that sums each phase's host seconds while the block runs."""
    global _totals
    previous, _totals = _totals, {}
    try:
        yield _totals
    finally:
        _totals = previous
