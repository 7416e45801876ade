"""AsyncEngine: the synchronous LLMEngine on its own thread, with an asyncio face.

The model runs on one thread. HTTP handlers never touch the engine: they put commands
(add, abort) in a thread-safe inbox and wake the loop; the loop drains the inbox, runs
``step()`` while there is work, and hands each request's outputs back to the event loop
that asked for them through ``call_soon_threadsafe``. New requests therefore join the
running batch at the next step.

A burst of requests (clients starting together) reaches the server over some
milliseconds, and an idle engine would start its first step, a prefill of tens or hundreds
of ms on a CPU, with whatever had arrived by then: the rest join over the next steps, beside
decodes, each step admitting only what its token budget allows, so the burst decodes as
staggered groups. With a burst window, an engine that was idle waits until no request has
arrived for the window (each arrival restarts it), at most BURST_WAIT_LIMIT windows in all,
and not at all once the waiting requests fill a step; then the burst is prefilled together.
Behind the HTTP server the engine waits only while a client could still send: when the
request's own connection is the only one open (a lone client), it does not wait at all. A
request whose client cannot be told apart from a burst's (other connections are open) pays
the window once, on its first token; requests reaching a busy engine never wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from archserve.engine.lora.request import LoRARequest
from archserve.engine.outputs import RequestOutput
from archserve.engine.sampling_params import SamplingParams

T = TypeVar("T")

log = logging.getLogger("archserve.serve")

# The longest an idle engine gathers a burst, in windows: requests arriving without pause
# (a steady stream, not a burst) are held at most this long.
BURST_WAIT_LIMIT = 5


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the loop that is awaiting it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop has closed: nobody is listening any more


# Called on the engine thread after every step with the outputs of that step, and with
# (request_id, "abort") for requests ended by the server; the metrics hook lives here.
StepObserver = Callable[[list[RequestOutput]], None]


class AsyncEngine:
    """Owns an LLMEngine and the thread that drives it."""

    def __init__(self, engine, observer: StepObserver | None = None,
                 abort_observer: Callable[[str], None] | None = None,
                 burst_window_s: float = 0.0) -> None:
        if burst_window_s < 0:
            raise ValueError(f"the burst window must be >= 0 seconds, got {burst_window_s}")
        self.engine = engine
        self.burst_window_s = burst_window_s
        # The HTTP connections the server holds open, where known (serve/launcher.py sets
        # it; None in process): with only the request's own, no other client can be about
        # to send.
        self.open_connections: Callable[[], int] | None = None
        self._observer = observer
        self._abort_observer = abort_observer
        self._inbox: deque[tuple] = deque()
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}       # touched only on the engine thread
        self._stopping = False
        self.ending = False                          # end_all was called: shutting down
        self._pending_adds = 0                       # adds in the inbox, not yet queued
        self._num_added = 0                          # adds drained, ever (engine thread)
        self._num_waiting = 0                        # the scheduler's queue, after the last step
        self._thread = threading.Thread(target=self._run, name="archserve-engine", daemon=True)
        self.dead_reason: str | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still running, stop the loop and wait for the thread."""
        self._submit(("stop",))
        self._thread.join(timeout)

    def end_all(self, reason: str) -> None:
        """End every request in flight now, each with a final output whose unfinished
        choices carry finish_reason "abort", so every client gets a proper ending; requests
        that arrive afterwards are refused. For a shutdown whose grace period has passed;
        ``reason`` is what the log says."""
        self.ending = True
        self._submit(("end_all", reason))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet running: in the inbox or the scheduler's queue."""
        return self._pending_adds + self._num_waiting

    # -- the asyncio side -------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) until it finishes.

        Raises ValueError when the engine rejects the request. If the consumer stops
        early (client gone: CancelledError or GeneratorExit), the request is aborted and
        its KV blocks are freed at the engine's next loop turn.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(("add", request_id, prompt, params, stream, lora_request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True          # the engine has already forgotten it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine thread between two steps (what changes the engine's
        state, such as its adapters); its exception is raised here."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        future: Future = Future()
        self._submit(("call", fn, future))
        return await asyncio.wrap_future(future)

    def _submit(self, command: tuple) -> None:
        with self._inbox_lock:
            self._inbox.append(command)
            if command[0] == "add":
                self._pending_adds += 1
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                was_idle = not self.engine.has_unfinished_requests()
                if not self._drain_inbox():
                    break
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    continue
                if was_idle and not self._gather_burst():
                    break
                self._step()
        except BaseException as exc:  # noqa: BLE001 - the loop must report why it died
            self.dead_reason = f"engine loop died: {type(exc).__name__}: {exc}"
            log.exception("%s", self.dead_reason)
            self._fail_all(EngineDeadError(self.dead_reason))
        finally:
            self._abort_everything()

    def _drain_inbox(self) -> bool:
        """Apply queued commands; False once a stop command has been seen."""
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    break
                command = self._inbox.popleft()
                if command[0] == "add":
                    self._pending_adds -= 1
            kind = command[0]
            if kind == "add":
                self._num_added += 1
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "end_all":
                self._end_all(command[1])
            elif kind == "call":
                _run_into(*command[1:])
            elif kind == "stop":
                self._stopping = True
        self._num_waiting = self.engine.stats()["num_waiting"]
        return not self._stopping

    def _gather_burst(self) -> bool:
        """An idle engine has work: wait for the rest of a burst (see the module's note).
        False once a stop command has been seen."""
        window = self.burst_window_s
        if not window or (self.open_connections is not None and self.open_connections() <= 1):
            return True
        scheduler = self.engine.scheduler
        now = last_arrival = time.monotonic()
        give_up = now + BURST_WAIT_LIMIT * window
        while not scheduler.waiting_fill_a_step():
            timeout = min(last_arrival + window, give_up) - now
            if timeout <= 0:
                break
            self._wake.wait(timeout)
            self._wake.clear()    # before the drain: a command after it sets it again
            added = self._num_added
            if not self._drain_inbox():
                return False
            now = time.monotonic()
            if self._num_added != added:
                last_arrival = now
        return True

    def _add(self, request_id: str, prompt, params: SamplingParams, stream: _Stream,
             lora_request: LoRARequest | None) -> None:
        if self.ending:
            stream.put(EngineDeadError("the server is shutting down"))
            return
        try:
            # Not add_request: a grammar still compiling must not hold up this thread (the
            # scheduler admits the request once it is ready; the server compiled it ahead).
            engine = self.engine
            engine.queue_request(engine.prepare_request(request_id, prompt, params,
                                                        lora_request=lora_request))
        except ValueError as exc:
            stream.put(exc)
            return
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if self.engine.abort_request(request_id) and self._abort_observer is not None:
            self._abort_observer(request_id)
        if stream is not None:
            stream.put(asyncio.CancelledError())

    def _end_all(self, reason: str) -> None:
        outputs = [output for output in map(self.engine.finish_aborted, list(self._streams))
                   if output is not None]
        if outputs:
            log.warning("%s with %d request(s) still running: they end now (streams with "
                        "finish_reason 'abort', other requests with a 503 error)",
                        reason, len(outputs))
        if self._observer is not None:
            self._observer(outputs)
        for output in outputs:
            self._streams.pop(output.request_id).put(output)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            if getattr(exc, "fatal", False):
                raise               # a lost worker: the engine cannot serve again
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(RuntimeError(f"the engine failed while running this request: "
                                        f"{type(exc).__name__}: {exc}"))
            return
        self._num_waiting = self.engine.stats()["num_waiting"]
        if self._observer is not None:
            self._observer(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request the engine holds (freeing its blocks) and tell its client."""
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            if self._abort_observer is not None:
                self._abort_observer(request_id)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    def _abort_everything(self) -> None:
        with self._inbox_lock:
            pending = [c for c in self._inbox if c[0] in ("add", "call")]
            self._inbox.clear()
            self._pending_adds = 0
        for command in pending:
            error = EngineDeadError("the server is shutting down")
            if command[0] == "call":
                command[2].set_exception(error)
            else:
                command[4].put(error)
        self._fail_all(EngineDeadError("the server is shutting down"))


def _run_into(fn: Callable[[], object], future: Future) -> None:
    """Run ``fn`` and put its result (or exception) into ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
        future.set_exception(exc)
