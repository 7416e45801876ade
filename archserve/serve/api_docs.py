"""What /openapi.json says about each route's responses, errors included.

FastAPI documents the request bodies from the pydantic models by itself; the responses
the handlers build by hand (JSON, SSE, errors from the guard in front of the app) are
declared here, so that a client generated from the schema, or a schema-driven fuzzer,
sees what the server really sends.
"""

from __future__ import annotations

from typing import Any

from archserve.serve.protocol import ErrorResponse

_ERROR_REASONS = {
    400: "The request is invalid (shape, range, or what the model allows); `param` names "
         "the field.",
    401: "The API key is missing or wrong (only /v1 routes need it).",
    404: "The model named in the request is not served here.",
    413: "The request body is larger than --max-request-bytes.",
    500: "An internal error.",
    503: "The server is busy (retry after `Retry-After` seconds) or its engine stopped.",
}

SSE = "text/event-stream"
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "One chunk as JSON, or `[DONE]` at the end."}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, all in the OpenAI error shape."""
    return {status: {"model": ErrorResponse, "description": _ERROR_REASONS[status]}
            for status in statuses}


def json_or_sse(model: type) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or with ``stream: true`` server-sent events whose
    ``data:`` lines are chunks of the same shape, ending with ``data: [DONE]``."""
    return {200: {"model": model, "description": "The result; with `stream: true`, "
                  "server-sent events.",
                  # Open API 3.1: the schema of a stream describes one event.
                  "content": {SSE: {"schema": _SSE_EVENT}}}}


def finish(schema: dict[str, Any]) -> dict[str, Any]:
    """The generated schema with two corrections: error statuses are JSON on every route
    (FastAPI would give /metrics's errors its text/plain), and no 422: FastAPI documents
    one for every route with a body, but this server answers invalid bodies with 400."""
    error_json = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            for status, response in responses.items():
                if int(status) in _ERROR_REASONS:
                    response["content"] = error_json
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
