"""Async plumbing for handlers: merging per-prompt streams, SSE framing, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from archserve.serve.errors import OpenAIError, error_body

T = TypeVar("T")
_DONE = object()
log = logging.getLogger("archserve.serve")


class ClientDisconnected(Exception):
    """The client left before its response: the request is aborted, nothing to report."""


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagged with their index.

    Leaving early (or an error in one) cancels the rest, which closes their generators
    and so aborts their engine requests.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_unset=False)
    else:
        text = json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    if isinstance(exc, OpenAIError):
        return sse(error_body(exc.message, exc.status, exc.param))
    return sse(error_body(f"{type(exc).__name__}: {exc}", 500))


async def sse_stream(chunks: AsyncIterator[str], usage_chunk: Callable[[], str | None]
                     ) -> AsyncIterator[str]:
    """The tail every streamed response shares: its chunks, then the usage chunk when the
    client asked for one, an error in-band if the stream fails once the status line is
    sent, and [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
        usage = usage_chunk()
        if usage is not None:
            yield usage
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
        yield sse_error(exc)
    yield SSE_DONE


@dataclass
class PendingTokens:
    """A streamed choice's tokens whose text has not gone out yet (part of a character, a
    possible stop string): they and their logprobs wait for the chunk that carries it."""

    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text_sent: int = 0         # characters of this choice already streamed
    num_tokens: int = 0        # tokens of this choice so far (usage)
    done: bool = False

    def add(self, token_ids: list, logprobs: list | None) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs or []
        self.num_tokens += len(token_ids)

    def take(self, text: str) -> tuple[list, list, int]:
        """The waiting tokens and logprobs, and where ``text`` starts in the choice."""
        out = self.token_ids, self.logprobs, self.text_sent
        self.token_ids, self.logprobs = [], []
        self.text_sent += len(text)
        return out


def _log_disconnect(request_id: str) -> None:
    # Clients leave all the time (timeouts, Ctrl-C); it is not a server error.
    log.info("%s: aborted, the client disconnected", request_id)


async def unless_disconnected(request: Request, work: Awaitable[Any], request_id: str,
                              poll_s: float = 0.2) -> Any:
    """Await ``work``; if the client goes away first, cancel it (aborting its requests)
    and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                _log_disconnect(request_id)
                raise ClientDisconnected(request_id)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def logging_disconnect(request_id: str, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """``body``, noting in the log when the client leaves before its end.

    Starlette ends a stream whose client left by cancelling it (CancelledError inside
    ``body``, which aborts the engine requests on its way out); a generator closed while
    suspended at a yield sees GeneratorExit instead.
    """
    try:
        async for chunk in body:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        _log_disconnect(request_id)
        raise
    finally:
        await body.aclose()   # at a GeneratorExit ``body`` is suspended, not finished
