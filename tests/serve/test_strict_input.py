"""Bodies that a lenient parser would coerce into something else are 400s naming the field.

OpenAI's API is strict about JSON types: "5" is not an integer, "yes" and 1 are not
booleans, true is not a token id. Numbers the sampler cannot represent are refused too.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = {"role": "user", "content": "hi"}


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    return error


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [USER, {"role": "", "content": "hi"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None}, USER]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [USER], "max_tokens": "5"}, "max_tokens"),
    ({"messages": [USER], "max_tokens": 5.0}, "max_tokens"),
    ({"messages": [USER], "max_completion_tokens": True}, "max_completion_tokens"),
    ({"messages": [USER], "stream": "yes"}, "stream"),
    ({"messages": [USER], "stream": 1}, "stream"),
    ({"messages": [USER], "logprobs": "true"}, "logprobs"),
    ({"messages": [USER], "n": True}, "n"),
    ({"messages": [USER], "temperature": "0.5"}, "temperature"),
    ({"messages": [USER], "temperature": True}, "temperature"),
    ({"messages": [USER], "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"messages": [USER], "allowed_token_ids": [True]}, "allowed_token_ids[0]"),
    ({"messages": [USER], "stop_token_ids": [2, False]}, "stop_token_ids[1]"),
    ({"messages": [USER], "logit_bias": {"5": True}}, "logit_bias.5"),
])
def test_chat_bodies_of_the_wrong_type_are_400(server, body, param):
    # A small budget keeps a wrongly accepted body from generating up to the context end.
    error = _error(_post(server, "/v1/chat/completions", {"max_tokens": 1, **body}))
    assert error["param"] == param, error
    assert param in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"prompt": [True, 5], "max_tokens": 1}, "prompt"),
    ({"prompt": [[5, True]], "max_tokens": 1}, "prompt"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "echo": "no"}, "echo"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "seed": "7"}, "seed"),
    # Values the float32 sampler would turn into inf or 0 (today: overflow warnings, nan).
    ({"prompt": "hi", "temperature": 1e300}, "temperature"),
    ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "top_p": 1e-300}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "top_k": 2**40}, "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "presence_penalty": -2.5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": 1e300}, "frequency_penalty"),
    ({"prompt": "hi", "n": 65}, "n"),
])
def test_completion_bodies_of_the_wrong_type_or_range_are_400(server, body, param):
    error = _error(_post(server, "/v1/completions", {"max_tokens": 1, **body}))
    assert error["param"] == param, error


def test_numbers_beyond_float32_are_refused_without_a_warning_in_the_log(server):
    for field, value in [("temperature", 1e300), ("temperature", 3.5e38), ("top_p", -1e300),
                         ("min_p", 1e39)]:
        error = _error(_post(server, "/v1/completions",
                             {"prompt": "hi", "max_tokens": 1, field: value}))
        assert error["param"] == field and "32-bit float" in error["message"], error
    assert "Warning" not in server.log, server.log


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}], "max_tokens": 1},
     "messages[0].role"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
])
def test_param_names_the_field_on_every_endpoint(server, path, body, param):
    assert _error(_post(server, path, body))["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "developer", "content": "Be brief."}, USER]},
    {"messages": [{"role": "system", "content": "Be brief."}, USER,
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "42"}, USER]},
    {"messages": [USER], "temperature": 1, "top_p": 1, "top_k": -1, "seed": 3,
     "repetition_penalty": 1.1, "presence_penalty": -2, "frequency_penalty": 2},
])
def test_valid_edge_cases_still_pass(server, body):
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_invalid_json_says_what_and_where(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi" "max_tokens": 1}',
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    error = _error(r)
    assert error["param"] is None
    assert error["message"] == ("invalid JSON in the request body at line 1, column 17: "
                                "Expecting ',' delimiter"), error
    r = httpx.post(f"{server.url}/v1/completions", content=b'{\n  "prompt": \n}',
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    error = _error(r)
    assert error["param"] is None and "at line 3, column 1: Expecting value" in error["message"]
