"""An optional per-step trace of a live engine, attached from outside the engine.

``trace_steps(engine)`` wraps the engine's ``scheduler.schedule`` (to see what each step
runs: per sequence, new tokens and the context already in the KV cache) and
``engine.step`` (to time the whole step) as instance attributes, and removes the
wrappers on exit. The engine's code is untouched and pays nothing when not traced.
On CUDA each step ends with a synchronize so its wall time covers its kernels, except
with ``async_scheduling``: a synchronize would undo the overlap being measured. Then a
call launches one step and waits for the one before it, so its time (mostly that wait) is
given to the step it resolved: the step the engine held in flight when the call began
(``LLMEngine._in_flight``). A call that resolved none gives its time to the step it
launched (only host work: the first call, or the first after the engine went idle). The
sum over the run is still the run's time. Given to the step launched instead, the first
decode step would carry the whole prefill's device time, which the prefill's own record
would miss.

Each record also keeps the host seconds of the engine's phases in its call
(engine/phases.py, by the clock): with async scheduling a call launches its step and
resolves the one before, so ``wait_for_device`` is the time the host waited for the device
and the rest of the call is host work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from archserve.engine.phases import WAIT_FOR_DEVICE, collect_phase_times


@dataclass(frozen=True)
class ScheduledWork:
    num_new_tokens: int
    context_len: int       # tokens already in the KV cache before this step
    samples: bool          # this chunk ends at the newest token: the LM head runs for it


@dataclass
class StepRecord:
    work: list[ScheduledWork]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)   # host seconds per phase

    @property
    def is_decode(self) -> bool:
        return bool(self.work) and all(w.num_new_tokens == 1 for w in self.work)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_new_tokens for w in self.work)


@dataclass
class StepTrace:
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def host_ms_per_decode_step(self) -> dict[str, float]:
        """Mean host milliseconds per decode step: each phase, ``busy`` (the call's time but
        the wait for the device) and ``step`` (the call's time); empty without decode steps."""
        decode = [s for s in self.steps if s.is_decode]
        if not decode:
            return {}
        names = sorted({name for s in decode for name in s.phases})
        means = {name: 1e3 * sum(s.phases.get(name, 0.0) for s in decode) / len(decode)
                 for name in names}
        step_ms = 1e3 * sum(s.seconds for s in decode) / len(decode)
        return {**means, "busy": step_ms - means.get(WAIT_FOR_DEVICE, 0.0), "step": step_ms}


@contextlib.contextmanager
def trace_steps(engine) -> Iterator[StepTrace]:
    trace = StepTrace()
    scheduler = engine.scheduler
    inner_schedule, inner_step = scheduler.schedule, engine.step
    # A tensor-parallel step returns once its ranks have finished it (they reply with its
    # tokens): the engine process has no CUDA work of its own to wait for.
    sync = (engine.runner.device.type == "cuda" and not engine.config.async_scheduling
            and engine.config.tensor_parallel_size == 1)
    pending: list[list[ScheduledWork]] = []
    # async: the engine's step in flight (its own object) and that step's record
    in_flight: dict[str, object] = {"step": None, "record": None}

    def schedule():
        out = inner_schedule()
        pending.append([ScheduledWork(e.num_new_tokens, e.seq.num_computed_tokens, e.samples)
                        for e in out.scheduled])
        return out

    def step():
        pending.clear()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            with collect_phase_times() as phases:
                outputs = inner_step()
            if sync:
                torch.cuda.synchronize(engine.runner.device)
        finally:     # a call that raised still took its time
            record(time.perf_counter() - t0, phases)
        return outputs

    def record(seconds: float, phases: dict[str, float]) -> None:
        launched = StepRecord(pending[-1], 0.0) if pending and pending[-1] else None
        if launched is not None:
            trace.steps.append(launched)
        # The engine's step in flight (async scheduling) tells what the call did: the one
        # there before it resolved (or dropped, on a failure) if it is gone; a new one there
        # is the step this call launched.
        now = getattr(engine, "_in_flight", None)
        resolved = in_flight["record"] if in_flight["step"] is not None \
            and now is not in_flight["step"] else None
        if now is not in_flight["step"]:
            in_flight.update(step=now, record=launched if now is not None else None)
        charged = next((r for r in (resolved, launched) if r is not None),
                       trace.steps[-1] if trace.steps else None)
        if charged is not None:
            charged.seconds += seconds
            for name, value in phases.items():
                charged.phases[name] = charged.phases.get(name, 0.0) + value

    scheduler.schedule, engine.step = schedule, step
    try:
        yield trace
    finally:
        del scheduler.schedule, engine.step    # back to the class methods
