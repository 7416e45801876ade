"""ASGI middleware in front of every route: API key, body size limit, status metrics.

It is plain ASGI (not a Starlette BaseHTTPMiddleware) so that streaming responses and
disconnect notifications pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from archserve.serve.body_errors import BODY_SCOPE_KEY
from archserve.serve.errors import error_body


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_request_bytes: int,
                 observe_status: Callable[[int], None]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.observe_status = observe_status

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_seen: list[int] = []

        async def send_observed(message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                self.observe_status(message["status"])
            await send(message)

        if not self._authorized(scope):
            await _send_error(send_observed, 401, "Invalid or missing API key "
                              "(send it as 'Authorization: Bearer <key>').",
                              {"www-authenticate": "Bearer"})
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send_observed, 413, _too_large(self.max_bytes))
            return
        body, more = await self._read_body(receive)
        if body is None:
            await _send_error(send_observed, 413, _too_large(self.max_bytes))
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # afterwards: http.disconnect, for the handlers

        if more is not None:   # the client went away while sending
            return
        # Kept for the error handlers: a body that fails to parse is quoted by position.
        scope[BODY_SCOPE_KEY] = body
        await self.app(scope, replay, send_observed)

    def _authorized(self, scope) -> bool:
        # As in vLLM, only the API (/v1) is guarded; /health and /metrics stay open.
        if self.api_key is None or not scope["path"].startswith("/v1"):
            return True
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(self, receive) -> tuple[bytes | None, dict | None]:
        """The whole body, or None once it exceeds the limit (the rest is not read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None, None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> str:
    return f"The request body is larger than the limit of {limit} bytes."


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
