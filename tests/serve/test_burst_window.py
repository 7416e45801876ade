"""The burst window: requests reaching an idle engine over a few ms are prefilled together.

A real engine (tiny random llama) behind AsyncEngine; what is asserted is the composition
of the steps the scheduler planned, never how long anything took. A window far longer than
the test makes the outcome independent of the machine's speed: the gather must end because
the waiting requests fill a step (or a stop arrives), not because time ran out.
"""

from __future__ import annotations

import asyncio

import pytest

from archserve import LLM, SamplingParams
from archserve.engine.scheduler import SchedulerOutput
from archserve.serve.async_engine import AsyncEngine, EngineDeadError

NUM_SEQS = 4
PROMPTS = [[1 + i, 17, 23, 29, 31, 37, 41, 43, 47, 53 + i] for i in range(NUM_SEQS)]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FOREVER_S = 600.0       # a window the test never sees end
GUARD_S = 120.0         # a gather that does not end when the step is full fails here


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=64,
               max_num_seqs=NUM_SEQS).llm_engine


def _record_steps(engine, monkeypatch) -> list[SchedulerOutput]:
    """Every non-empty step the scheduler plans, in order."""
    planned: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        if not out.is_empty:
            planned.append(out)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return planned


async def _burst(served: AsyncEngine, prompts, gap_s: float) -> list[list[int]]:
    """Send ``prompts`` one every ``gap_s`` (each client's request as the server submits
    it) and return each one's tokens."""
    async def one(i: int, prompt) -> list[int]:
        outputs = [o async for o in served.generate(f"burst-{i}", prompt, GREEDY)]
        return list(outputs[-1].outputs[0].token_ids)

    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(i, prompt)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def _serve_burst(engine, monkeypatch, window_s: float, prompts, gap_s: float,
                 open_connections: int | None = None):
    """Serve ``prompts`` (one every ``gap_s``) through an AsyncEngine with this window;
    returns the steps planned and each prompt's tokens."""
    planned = _record_steps(engine, monkeypatch)
    served = AsyncEngine(engine, burst_window_s=window_s)
    if open_connections is not None:
        served.open_connections = lambda: open_connections
    served.start()
    try:
        tokens = asyncio.run(asyncio.wait_for(_burst(served, prompts, gap_s), GUARD_S))
    finally:
        served.shutdown()
    return planned, tokens


def engine_tokens(engine, prompt) -> list[int]:
    """The prompt's greedy tokens when it runs alone, through the synchronous engine."""
    rid = engine.add_request(None, prompt, GREEDY)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return list(last.outputs[0].token_ids)


@pytest.mark.parametrize("open_connections", [None, NUM_SEQS],
                         ids=["in-process", "other-connections-open"])
def test_a_burst_reaching_an_idle_engine_is_prefilled_in_one_step(engine, monkeypatch,
                                                                  open_connections):
    planned, tokens = _serve_burst(engine, monkeypatch, FOREVER_S, PROMPTS, 0.003,
                                   open_connections)
    first = planned[0]
    assert sorted(e.seq.request_id for e in first.scheduled) == [
        f"burst-{i}" for i in range(NUM_SEQS)]
    assert all(e.samples and e.num_new_tokens == len(p)
               for e, p in zip(sorted(first.scheduled, key=lambda e: e.seq.request_id),
                               PROMPTS, strict=True))
    # Gathered, the requests decode as one batch to the end: every later step carries all.
    assert all(len(out.scheduled) == NUM_SEQS for out in planned[1:])
    assert tokens == [engine_tokens(engine, p) for p in PROMPTS]


def test_without_a_window_the_first_step_takes_only_what_has_arrived(engine, monkeypatch):
    """The case the window is for: the second request reaches the engine after its first
    step has been planned (the first request's first token is already out) and so joins a
    later step."""
    planned = _record_steps(engine, monkeypatch)
    served = AsyncEngine(engine)          # the default: no window

    async def first_then_second():
        stream = served.generate("early", PROMPTS[0], GREEDY)
        await anext(stream)                  # its prefill step has run
        late = [o async for o in served.generate("late", PROMPTS[1], GREEDY)]
        rest = [o async for o in stream]
        return late, rest

    served.start()
    try:
        asyncio.run(asyncio.wait_for(first_then_second(), GUARD_S))
    finally:
        served.shutdown()
    assert [e.seq.request_id for e in planned[0].scheduled] == ["early"]


@pytest.mark.parametrize(("window_s", "open_connections"), [(0.02, None), (FOREVER_S, 1)],
                         ids=["the-window-passes", "a-lone-client-does-not-wait"])
def test_a_lone_request_is_served(engine, monkeypatch, window_s, open_connections):
    """Once its window passes; or at once behind the HTTP server when its connection is
    the only one open (with a window that never ends, the guard fails a gather)."""
    planned, tokens = _serve_burst(engine, monkeypatch, window_s, PROMPTS[:1], 0.0,
                                   open_connections)
    assert tokens == [engine_tokens(engine, PROMPTS[0])]
    assert [e.seq.request_id for e in planned[0].scheduled] == ["burst-0"]


def test_a_stop_during_the_gather_ends_the_waiting_request(engine):
    served = AsyncEngine(engine, burst_window_s=FOREVER_S)
    served.start()

    async def wait_then_stop():
        stream = served.generate("waiting", PROMPTS[0], GREEDY)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)            # submitted: the engine is gathering
        await asyncio.to_thread(served.shutdown)
        with pytest.raises(EngineDeadError):
            await first

    asyncio.run(asyncio.wait_for(wait_then_stop(), GUARD_S))
    assert not served.is_alive
    assert not engine.has_unfinished_requests()


def test_a_negative_window_is_refused(engine):
    with pytest.raises(ValueError, match="burst window"):
        AsyncEngine(engine, burst_window_s=-1.0)


@pytest.mark.parametrize(("text", "expected"), [("auto", None), ("0", 0.0), ("12.5", 12.5)])
def test_burst_window_option(text, expected):
    from archserve.cli.serve import parse_burst_window
    assert parse_burst_window(text) == expected


@pytest.mark.parametrize("text", ["-1", "soon", "inf", "nan"])
def test_a_bad_burst_window_option_is_refused(text):
    import typer

    from archserve.cli.serve import parse_burst_window
    with pytest.raises(typer.BadParameter, match="--burst-window-ms|auto or a number"):
        parse_burst_window(text)
