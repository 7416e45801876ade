"""OpenAI-shaped errors: one exception type, one JSON body, one place that maps status codes."""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

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


# JSON's \u escapes can carry half of a UTF-16 pair alone; such text has no UTF-8 form.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(value: Any, param: str) -> None:
    """A 400 naming the first string in ``value`` (a string, or lists and dicts of them)
    that is not valid Unicode, before a tokenizer or template fails on it obscurely."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is not None:
            raise OpenAIError(f"{param} is not valid Unicode: it holds a lone surrogate "
                              f"(U+{ord(found.group()):04X}) at character {found.start()}",
                              param=param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(item, f"{param}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{param}[{i}]")


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
