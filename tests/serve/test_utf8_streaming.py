"""Text is sent in whole characters: a character split over tokens is held back until it
is complete, and one cut off by max_tokens or a stop token is dropped, never sent as
U+FFFD. Mid-stream chunks always carry text.

The model is confined to the three byte-level tokens of one emoji (allowed_token_ids)
and prompted with a row of that emoji, so greedy decoding spells it again and again.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
EMOJI = "\U0001F600"


@pytest.fixture(scope="module")
def emoji_ids(server) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                   json={"prompt": EMOJI, "add_special_tokens": False})
    ids = r.json()["tokens"]
    assert len(ids) == 3      # the premise: one character, three tokens
    return ids


def _body(emoji_ids, chat: bool, **extra) -> dict:
    body = {"temperature": 0, "allowed_token_ids": emoji_ids, **extra}
    if chat:
        return {"messages": [{"role": "user", "content": EMOJI * 6}], **body}
    return {"prompt": EMOJI * 6, **body}


def _text(choice: dict, chat: bool) -> str | None:
    return choice["delta"].get("content") if chat else choice["text"]


def _stream(server, path: str, body: dict) -> list[dict]:
    choices = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[len("data: "):])["choices"]
    return choices


CASES = [   # (extra request fields, the text, the finish reason)
    ({"max_tokens": 1}, "", "length"),                 # one byte of four
    ({"max_tokens": 4}, EMOJI, "length"),              # one whole emoji, one byte more
    ({"max_tokens": 8}, EMOJI * 2, "length"),
    ({"max_tokens": 9}, EMOJI * 3, "length"),          # ends exactly on a boundary
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("extra, text, reason", CASES)
def test_no_replacement_character_at_the_end(server, emoji_ids, chat, extra, text, reason):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", json=_body(emoji_ids, chat, **extra), headers=AUTH,
                   timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == text
    assert choice["finish_reason"] == reason


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stop_token_inside_a_character_drops_its_start(server, emoji_ids, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # The emoji's middle byte stops the request (and is not output): one byte is left.
    body = _body(emoji_ids, chat, max_tokens=20, stop_token_ids=[emoji_ids[1]])
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == ""
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == emoji_ids[1]
    _assert_whole_characters(_stream(server, path, body), chat, "", "stop")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("extra, text, reason", CASES)
def test_stream_chunks_carry_whole_characters(server, emoji_ids, chat, extra, text, reason):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _assert_whole_characters(_stream(server, path, _body(emoji_ids, chat, **extra)), chat,
                             text, reason)


def _assert_whole_characters(choices: list[dict], chat: bool, text: str, reason: str) -> None:
    if chat:   # the role comes first, with empty content (as OpenAI sends it)
        assert choices[0]["delta"]["role"] == "assistant"
        choices = choices[1:]
    *middle, last = choices
    assert last["finish_reason"] == reason
    assert all(c["finish_reason"] is None for c in middle)
    pieces = [_text(c, chat) for c in middle]
    assert all(pieces), pieces                         # no empty delta mid-stream
    assert "".join(pieces) + (_text(last, chat) or "") == text
