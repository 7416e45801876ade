"""Which step a call's time is given to, with and without async scheduling.

The engine here is a stand-in with a clock of its own: the trace's bookkeeping is the
thing under test, and a real device's timing would make the attribution unobservable
(on CPU a step's work is done by the time it is launched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from archserve.bench import step_trace
from archserve.bench.step_trace import trace_steps


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Scheduler:
    def __init__(self, steps: list[int]) -> None:
        self.steps = list(steps)          # new tokens of each step, one sequence

    def schedule(self):
        if not self.steps:
            return SimpleNamespace(scheduled=[])
        n = self.steps.pop(0)
        seq = SimpleNamespace(num_computed_tokens=0)
        return SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=n, seq=seq,
                                                          samples=True)])


class _Engine:
    """Device seconds of a step: 10 a prefill, 1 a decode; the host costs nothing.

    Async: a call launches the next step and then waits for the one before it. Sync: a
    call launches a step and waits for it."""

    def __init__(self, clock: _Clock, async_scheduling: bool) -> None:
        self.clock = clock
        self.scheduler = _Scheduler([8, 1, 1, 1])
        self.config = SimpleNamespace(async_scheduling=async_scheduling,
                                      tensor_parallel_size=1)
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"))
        self.in_flight: int | None = None

    def step(self):
        out = self.scheduler.schedule()
        launched = out.scheduled[0].num_new_tokens if out.scheduled else None
        if self.config.async_scheduling:
            if self.in_flight is not None:
                self.clock.now += 10.0 if self.in_flight > 1 else 1.0
            self.in_flight = launched
        elif launched is not None:
            self.clock.now += 10.0 if launched > 1 else 1.0
        return []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_calls_time_goes_to_the_step_it_waited_for(monkeypatch, async_scheduling):
    clock = _Clock()
    monkeypatch.setattr(step_trace.time, "perf_counter", clock)
    engine = _Engine(clock, async_scheduling)
    with trace_steps(engine) as trace:
        for _ in range(6):                # the last calls only resolve, then idle
            engine.step()
    # The first decode step does not carry the prefill's device time.
    assert [(s.num_tokens, s.seconds) for s in trace.steps] == [
        (8, 10.0), (1, 1.0), (1, 1.0), (1, 1.0)]
    assert trace.seconds == clock.now
