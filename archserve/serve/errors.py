"""OpenAI-shaped errors: one exception type, one JSON body, one place that maps status codes."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi.responses import JSONResponse

# OpenAI's error "type" for each status the server emits.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}


class OpenAIError(Exception):
    """An error the client caused or must wait out; rendered as ``{"error": {...}}``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message,
                      "type": _ERROR_TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message that quotes client text containing a
    lone surrogate still renders (UTF-8 encoding of such text would raise)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return AsciiJSONResponse(error_body(message, status, param), status_code=status,
                             headers=headers)


def from_exception(exc: OpenAIError) -> JSONResponse:
    return error_response(exc.message, exc.status, exc.param, exc.headers)
