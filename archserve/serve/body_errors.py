"""Why a request body could not be parsed, said as precisely as a JSON syntax error is:
what is wrong, and at which line and column.

FastAPI reports a JSON syntax error with its position, but any other failure to parse a
body (bytes that are not UTF-8, nesting deeper than the parser's recursion allows) as
one generic "There was an error parsing the body", with the cause chained. These
messages replace that one.
"""

from __future__ import annotations

import re

# The request's whole body, as the request guard read it (scope key).
BODY_SCOPE_KEY = "archserve.body"
# Within this many levels the parser never runs out of recursion (its limit is about
# 1,000 levels less what the server's own call stack uses); a body that failed to parse
# for its depth nests deeper, and the message points at the level past this one.
SAFE_NESTING = 512
# A JSON string (skipped whole: brackets inside it do not nest) or a bracket.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _line_column(data: bytes, pos: int) -> tuple[int, int]:
    """1-based line, and column in characters, of byte ``pos``."""
    start = data.rfind(b"\n", 0, pos) + 1
    return data.count(b"\n", 0, pos) + 1, len(data[start:pos].decode("utf-8", "replace")) + 1


def json_error_message(reason: str, doc: object, pos: object) -> str:
    """A JSON syntax error at character ``pos`` of ``doc``."""
    if isinstance(doc, str) and isinstance(pos, int):
        line = doc.count("\n", 0, pos) + 1
        column = pos - doc.rfind("\n", 0, pos)
        return f"invalid JSON in the request body at line {line}, column {column}: {reason}"
    return f"invalid JSON in the request body: {reason}"


def parse_failure_message(cause: BaseException | None, body: bytes | None) -> str | None:
    """The message for a body that failed to parse because of ``cause``; None for a cause
    this does not know (the generic message stands)."""
    if isinstance(cause, UnicodeDecodeError) and isinstance(cause.object, bytes):
        line, column = _line_column(cause.object, cause.start)
        byte = cause.object[cause.start]
        return (f"the request body is not valid UTF-8 at line {line}, column {column}: "
                f"byte 0x{byte:02x} ({cause.reason})")
    if isinstance(cause, RecursionError):
        where = _too_deep(body) if body is not None else None
        at = f"level {SAFE_NESTING + 1} opens at line {where[0]}, column {where[1]}; " \
            if where else ""
        return (f"the request body's JSON nests arrays and objects too deeply to parse ({at}"
                f"up to {SAFE_NESTING} levels always parse)")
    return None


def _too_deep(body: bytes) -> tuple[int, int] | None:
    """Line and column of the first bracket past SAFE_NESTING levels (the scan stops there,
    so a body of millions of brackets costs only the first few hundred)."""
    depth = 0
    for token in _TOKEN.finditer(body):
        char = token.group()[:1]
        if char in (b"[", b"{"):
            depth += 1
            if depth > SAFE_NESTING:
                return _line_column(body, token.start())
        elif char in (b"]", b"}"):
            depth -= 1
    return None
