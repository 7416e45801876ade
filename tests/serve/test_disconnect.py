"""A client that leaves mid-request is routine: one INFO line, no traceback in the log."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serve.conftest import API_KEY, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}


def _log_after(server, offset: int, needle: str, timeout: float = 15.0) -> list[str]:
    """The server's log lines written since ``offset`` once one contains ``needle``."""
    deadline = time.monotonic() + timeout
    while True:
        new = server.log[offset:]
        if needle in new or time.monotonic() > deadline:
            return new.splitlines()
        time.sleep(0.2)


def _assert_one_abort_line(lines: list[str], needle: str) -> None:
    assert not [line for line in lines if "Traceback" in line or "ERROR" in line], lines
    aborts = [line for line in lines if needle in line]
    assert len(aborts) == 1, lines
    assert aborts[0].startswith("INFO") and "client disconnected" in aborts[0], aborts


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 1000."}],
                              **{k: v for k, v in LONG.items() if k != "prompt"}}),
])
def test_streaming_disconnect_logs_one_info_line(server, path, body):
    wait_idle(server.url)
    offset = len(server.log)
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      headers=AUTH, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[len("data: "):])["id"]    # the client has gone away
    idle = wait_idle(server.url)
    assert idle["archserve:kv_cache_used_blocks"] == 0
    _assert_one_abort_line(_log_after(server, offset, request_id), request_id)


def test_non_streaming_disconnect_logs_one_info_line(server):
    wait_idle(server.url)
    offset = len(server.log)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=AUTH,
                   timeout=httpx.Timeout(60, read=1.5))
    idle = wait_idle(server.url)
    assert idle["archserve:kv_cache_used_blocks"] == 0
    lines = _log_after(server, offset, "client disconnected")
    # The client never saw the id; the line still names the request it aborted.
    _assert_one_abort_line(lines, "client disconnected")
    assert "cmpl-" in next(line for line in lines if "client disconnected" in line)
