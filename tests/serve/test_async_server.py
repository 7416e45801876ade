"""A server with --async-scheduling answers exactly as the default one does.

The same greedy and seeded requests (streaming and not, with stop strings and logprobs)
go to both servers; a disconnect mid-stream still aborts and frees the request's blocks.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import API_KEY, start_server, wait_idle

REQUESTS = [
    {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0},
    {"prompt": "List three colours:", "max_tokens": 40, "temperature": 0, "stop": ["\n\n", "4."]},
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "seed": 7, "n": 2,
     "logprobs": 2},
    {"prompt": "1, 2, 3,", "max_tokens": 30, "temperature": 0, "ignore_eos": True},
]


@pytest.fixture(scope="module")
def async_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-async") / "server.log",
                       "--api-key", API_KEY, "--async-scheduling")
    yield srv
    assert srv.stop() == 0, srv.log


def _complete(url: str, body: dict) -> list[tuple]:
    r = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return [(c["index"], c["text"], c["finish_reason"],
             None if c["logprobs"] is None else c["logprobs"]["tokens"])
            for c in r.json()["choices"]]


def _stream_text(url: str, body: dict) -> str:
    import json
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


@pytest.mark.parametrize("body", REQUESTS, ids=range(len(REQUESTS)))
def test_async_server_matches_the_default_one(server, async_server, body):
    assert _complete(async_server.url, body) == _complete(server.url, body)


def test_async_streaming_and_disconnect(async_server):
    body = REQUESTS[0]
    assert _stream_text(async_server.url, body) == _complete(async_server.url, body)[0][1]
    long = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{async_server.url}/v1/completions", json=long,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)      # two chunks arrived; then the client goes away
    metrics = wait_idle(async_server.url)
    assert metrics["archserve:kv_cache_used_blocks"] == 0
    assert metrics["archserve:num_requests_running"] == 0
