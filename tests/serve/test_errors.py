"""Every error status the server emits, in the OpenAI error shape; none is a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error


def test_api_key_is_required_on_v1_only(server):
    body = {"prompt": "hi", "max_tokens": 1}
    _assert_error(_post(server, "/v1/completions", body, headers={}), 401)
    _assert_error(_post(server, "/v1/completions", body,
                        headers={"Authorization": "Bearer wrong-key"}), 401)
    _assert_error(_post(server, "/v1/completions", body,
                        headers={"Authorization": API_KEY}), 401)      # no Bearer scheme
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)


def test_context_length_message_names_the_lengths(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                       messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=MAX_MODEL_LEN)
    message = info.value.body["message"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
    assert "in the messages" in message and f"{MAX_MODEL_LEN} in the completion" in message
    long_prompt = "word " * (MAX_MODEL_LEN + 10)
    error = _assert_error(_post(server, "/v1/completions",
                                {"prompt": long_prompt, "max_tokens": 1}), 400)
    assert "input tokens" in error["message"] and error["param"] == "prompt"


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "n": 10_000},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "logprobs": 1000},
    {"prompt": "hi", "presence_penalty": 5},
    {"prompt": "hi", "stop_token_ids": [10**9]},
    {"prompt": "hi", "min_tokens": 5, "max_tokens": 2},
    {"prompt": "hi", "seed": 2**70},
    {"prompt": "hi", "best_of": 3},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [-1, 5]},
    {"prompt": [10**8]},
    {"prompt": {"not": "a prompt"}},
    {"max_tokens": 3},
    [1, 2, 3],
])
def test_invalid_completion_parameters_are_400(server, body):
    _assert_error(_post(server, "/v1/completions", body), 400)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": "hello"},
])
def test_invalid_chat_parameters_are_400(server, body):
    _assert_error(_post(server, "/v1/chat/completions", body), 400)


def test_bad_json_is_400(server):
    for raw in (b"{not json", b"", b"\xff\xfe", b'{"prompt": NaN}'):
        r = httpx.post(f"{server.url}/v1/completions", content=raw,
                       headers={**AUTH, "Content-Type": "application/json"})
        _assert_error(r, 400)


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)
    _assert_error(httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH), 404)
    _assert_error(httpx.get(f"{server.url}/nothing-here"), 404)


def test_oversized_body_is_413(server):
    big = {"prompt": "x" * 70_000, "max_tokens": 1}
    _assert_error(_post(server, "/v1/completions", big), 413)

    def chunks():   # no Content-Length: the limit holds on the streamed body too
        for _ in range(20):
            yield b" " * 8192
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"})
    _assert_error(r, 413)


def test_server_still_serves_after_errors(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2



def _post_raw(server, path: str, body: dict) -> httpx.Response:
    """JSON written with ASCII escapes, so a lone surrogate travels as \\udXXX."""
    import json
    return httpx.post(f"{server.url}{path}", content=json.dumps(body),
                      headers={"Content-Type": "application/json", **AUTH}, timeout=60)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}),
    ("/tokenize", {"prompt": "\ud800"}),
])
def test_lone_surrogates_are_a_400(server, path, body):
    assert _assert_error(_post_raw(server, path, body), 400)["param"] == "prompt"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "hi \udfff"}]}]},
     "messages[1].content[0].text"),
    ({"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "description": "\ud83d",
                                                  "parameters": {"type": "object"}}}]},
     "tools[0].function.description"),
])
def test_a_lone_surrogate_in_a_chat_is_a_400_saying_it_is_not_unicode(server, body, param):
    error = _assert_error(_post_raw(server, "/v1/chat/completions",
                                    {**body, "max_tokens": 2}), 400)
    assert error["param"] == param, error
    assert "is not valid Unicode" in error["message"] and "lone surrogate" in error["message"]
    assert "Error" not in error["message"], error     # no TypeError leaking from a tokenizer


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "caf\xe9", "max_tokens": 1}',
     "not valid UTF-8 at line 1, column 16: byte 0xe9 (invalid continuation byte)"),
    (b'{"prompt": "ok",\n "max_tokens": 1}\n\xff',
     "not valid UTF-8 at line 3, column 1: byte 0xff (invalid start byte)"),
    # Brackets inside a string do not nest; the nesting itself begins at column 23.
    (b'{"prompt": "[[[", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "nests arrays and objects too deeply to parse (level 513 opens at line 1, column 535;"),
    # Level 1 is the body's own object: the 512th '{"a":' opens level 513.
    (b'{"prompt": "hi",\n"x": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}",
     "level 513 opens at line 2, column 2561;"),   # 5 for '"x": ', 511 x 5 before it
])
def test_bodies_that_do_not_parse_say_what_and_where(server, body, message):
    r = httpx.post(f"{server.url}/v1/completions", content=body,
                   headers={"Content-Type": "application/json", **AUTH}, timeout=60)
    error = _assert_error(r, 400)
    assert message in error["message"], error


def test_error_messages_quoting_a_surrogate_still_render(server):
    _assert_error(_post_raw(server, "/v1/completions", {"model": "\ud800", "prompt": "hi"}), 404)


@pytest.mark.parametrize("method, path, allowed", [
    ("POST", "/v1/models", {"GET"}),
    ("DELETE", "/v1/models", {"GET"}),
    ("GET", "/v1/completions", {"POST"}),
    ("PUT", "/v1/chat/completions", {"POST"}),
])
def test_method_not_allowed_names_the_allowed_methods(server, method, path, allowed):
    r = httpx.request(method, f"{server.url}{path}", headers=AUTH, timeout=60)
    _assert_error(r, 405)
    # Starlette lets HEAD through wherever GET is allowed; the header may say so too.
    named = {m.strip() for m in r.headers["allow"].split(",")}
    assert allowed <= named <= allowed | {"HEAD"}, r.headers["allow"]
