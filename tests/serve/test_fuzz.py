"""Property-based fuzzing of the request schema: no 5xx, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

# Values of every JSON type, including ones that are wrong for any field.
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                 st.lists(st.integers(-5, 60000), max_size=4), st.dictionaries(
                     st.text(max_size=5), st.integers(), max_size=2))
small_int = st.one_of(st.integers(-3, 4), st.sampled_from([10**9, 2**64]), junk)
# Budgets stay small when valid, so a request that is accepted finishes quickly.
max_tokens = st.one_of(st.integers(-2, 3), st.sampled_from([0, 10**12]), st.text(max_size=3))
prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-3, 60000), max_size=6),
                   st.lists(st.text(max_size=10), max_size=3),
                   st.lists(st.lists(st.integers(0, 50000), max_size=3), max_size=2), junk)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"])},
                                optional={"content": st.one_of(st.text(max_size=30), junk)})

common = {
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=8), junk),
    "n": small_int, "temperature": st.one_of(st.floats(-1, 3), junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), junk), "top_k": small_int,
    "min_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "presence_penalty": st.one_of(st.floats(-3, 3), junk),
    "frequency_penalty": st.one_of(st.floats(-3, 3), junk),
    "repetition_penalty": st.one_of(st.floats(-1, 20), junk),
    "seed": st.one_of(st.integers(-2**65, 2**65), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 60000), max_size=3), junk),
    "min_tokens": small_int, "ignore_eos": st.one_of(st.booleans(), junk),
    "stream": st.booleans(), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
}
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": max_tokens},
    optional={**common, "echo": st.one_of(st.booleans(), junk), "logprobs": small_int,
              "best_of": small_int, "suffix": junk})
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), junk), "max_tokens": max_tokens},
    optional={**common, "logprobs": st.one_of(st.booleans(), junk),
              "top_logprobs": small_int, "max_completion_tokens": max_tokens})
endpoint_and_body = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_body),
    st.tuples(st.just("/v1/chat/completions"), chat_body),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                               "/detokenize"]), junk))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(endpoint_and_body)
def test_fuzzed_bodies_never_5xx(http, case):
    path, body = case
    raw = json.dumps(body)       # NaN and Infinity go out as the non-standard literals
    response = http.post(path, content=raw)
    assert response.status_code < 500, (path, raw, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["code"] == response.status_code
    elif body.get("stream") is True and isinstance(body, dict):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text, response.text


def test_healthy_after_fuzzing(http, server):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    from tests.serve.conftest import wait_idle
    assert wait_idle(server.url)["archserve:kv_cache_used_blocks"] == 0
