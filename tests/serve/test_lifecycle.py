"""A second server with a tiny queue: 503 when full, disconnects abort, SIGTERM exits 0."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.conftest import read_metrics, start_server, wait_idle

LONG = {"prompt": "Count from one to one hundred:", "max_tokens": 200, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-small") / "server.log",
                       "--max-num-seqs", "1", "--max-queued-requests", "1",
                       "--shutdown-timeout", "5")
    yield srv
    srv.stop()


def _wait_for(url: str, name: str, value: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while read_metrics(url)[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.1)


def test_full_queue_is_503_with_retry_after(small_server):
    url = small_server.url
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as a:
            a_lines = a.iter_lines()   # keep a reference: a collected iterator closes A
            next(a_lines)                              # A is running (max_num_seqs=1)
            with http.stream("POST", f"{url}/v1/completions",
                             json={**LONG, "stream": True}) as b:
                assert b.status_code == 200
                _wait_for(url, "archserve:num_requests_waiting", 1)   # B waits
                c = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert c.status_code == 503
                assert c.headers["retry-after"] == "1"
                assert c.json()["error"]["code"] == 503
    # Both streams were closed by their clients: their requests are aborted, blocks freed.
    idle = wait_idle(url)
    assert idle["archserve:kv_cache_used_blocks"] == 0
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_non_streaming_disconnect_aborts(small_server):
    url = small_server.url
    before = read_metrics(url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.5))
    after = wait_idle(url, timeout=20)
    key = 'archserve:request_success_total{finished_reason="abort"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["archserve:kv_cache_used_blocks"] == 0
    # Far fewer than the 200 requested tokens were generated before the abort landed.
    assert after["archserve:generation_tokens_total"] - before["archserve:generation_tokens_total"] < 150


def test_a_burst_cannot_overshoot_the_queue_limit(small_server):
    """32 streams at once on a server that runs 1 and queues 1: at most 2 are accepted."""
    import asyncio

    async def one(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", f"{small_server.url}/v1/completions",
                                 json={**LONG, "stream": True, "max_tokens": 4}) as r:
            status = r.status_code
            async for _ in r.aiter_lines():
                pass
            return status

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(32)))

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 503}
    assert 1 <= statuses.count(200) <= 2, statuses
    assert wait_idle(small_server.url)["archserve:kv_cache_used_blocks"] == 0


def test_sigterm_drains_and_exits_zero(small_server):
    url = small_server.url
    body = {**LONG, "max_tokens": 12, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as stream:
            lines = iter(stream.iter_lines())
            next(lines)
            small_server.process.terminate()           # SIGTERM while a stream is open
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"                  # the in-flight request finished
    assert small_server.process.wait(30) == 0, small_server.log
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
