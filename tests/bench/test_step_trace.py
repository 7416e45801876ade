"""Which step a call's time is given to, with and without async scheduling.

The engine here is a stand-in with a clock of its own: the trace's bookkeeping is the
thing under test, and a real device's timing would make the attribution unobservable
(on CPU a step's work is done by the time it is launched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from archserve.bench import step_trace
from archserve.bench.step_trace import trace_steps

PREFILL_S, DECODE_S = 10.0, 1.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Scheduler:
    def __init__(self, steps: list[int | None]) -> None:
        self.steps = list(steps)     # new tokens of each step, one sequence; None: nothing

    def schedule(self):
        n = self.steps.pop(0) if self.steps else None
        if n is None:
            return SimpleNamespace(scheduled=[])
        seq = SimpleNamespace(num_computed_tokens=0)
        return SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=n, seq=seq,
                                                          samples=True)])


class _Engine:
    """LLMEngine.step's shape, its device seconds on the clock (a prefill 10, a decode 1;
    the host costs nothing). Async: a call launches the next step, then waits for the one
    in flight (``_in_flight``), or only waits where it cannot overlap. Sync: a call
    launches a step and waits for it. ``fail_launch``: calls whose launch raises."""

    def __init__(self, clock: _Clock, async_scheduling: bool, steps: list[int | None],
                 no_overlap: tuple[int, ...] = (), fail_launch: tuple[int, ...] = ()) -> None:
        self.clock = clock
        self.scheduler = _Scheduler(steps)
        self.config = SimpleNamespace(async_scheduling=async_scheduling,
                                      tensor_parallel_size=1)
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"))
        self._in_flight = None
        self.no_overlap, self.fail_launch = no_overlap, fail_launch
        self.calls = 0

    def _wait(self, launched) -> None:   # noqa: ANN001
        self.clock.now += PREFILL_S if launched.scheduled[0].num_new_tokens > 1 else DECODE_S

    def step(self):
        self.calls += 1
        if self._in_flight is not None and self.calls in self.no_overlap:
            self._finish()
            return []
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self._in_flight is not None:
                self._finish()
            return []
        if self.calls in self.fail_launch:
            raise RuntimeError("launch failed")
        if not self.config.async_scheduling:
            self._wait(out)
            return []
        if self._in_flight is not None:
            self._finish()
        self._in_flight = out
        return []

    def _finish(self) -> None:
        launched, self._in_flight = self._in_flight, None
        self._wait(launched)


def _run(engine: _Engine, calls: int) -> list[tuple[int, float]]:
    with trace_steps(engine) as trace:
        for _ in range(calls):
            try:
                engine.step()
            except RuntimeError:
                pass
    assert trace.seconds == engine.clock.now
    return [(s.num_tokens, s.seconds) for s in trace.steps]


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(step_trace.time, "perf_counter", clock)
    return clock


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_calls_time_goes_to_the_step_it_waited_for(clock, async_scheduling):
    # The last calls only resolve, then find nothing to do.
    records = _run(_Engine(clock, async_scheduling, [8, 1, 1, 1]), 6)
    # The first decode step does not carry the prefill's device time.
    assert records == [(8, PREFILL_S), (1, DECODE_S), (1, DECODE_S), (1, DECODE_S)]


def test_a_call_that_cannot_overlap_only_resolves(clock):
    # Call 2 waits for the prefill alone; call 3 launches with nothing in flight.
    records = _run(_Engine(clock, True, [8, 1, 1], no_overlap=(2,)), 5)
    assert records == [(8, PREFILL_S), (1, DECODE_S), (1, DECODE_S)]


def test_an_idle_engine_then_a_new_request(clock):
    records = _run(_Engine(clock, True, [8, 1, None, None, 8, 1]), 8)
    assert records == [(8, PREFILL_S), (1, DECODE_S), (8, PREFILL_S), (1, DECODE_S)]


def test_a_launch_that_fails_leaves_the_step_in_flight_to_the_next_call(clock):
    # Call 2's launch raises before it waits: the prefill stays in flight, and call 3
    # resolves it; the failed step's record keeps no time.
    records = _run(_Engine(clock, True, [8, 1, 1], fail_launch=(2,)), 4)
    assert records == [(8, PREFILL_S), (1, 0.0), (1, DECODE_S)]
