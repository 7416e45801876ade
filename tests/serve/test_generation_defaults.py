"""Defaults for what a request leaves unset: the checkpoint's generation_config.json (vLLM's
``--generation-config auto``) and ``--max-tokens-default``; a request's own value wins."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.serve.conftest import start_server

USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def tuned_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny model whose generation_config.json asks for greedy decoding, 3 tokens."""
    path = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(temperature=0.0, top_p=0.9, max_new_tokens=3)
    config_path.write_text(json.dumps(config))
    return str(path)


def _serve(tmp_path_factory, checkpoint: str, *flags: str):
    return start_server(tmp_path_factory.mktemp("serve-gen") / "server.log",
                        "--model", checkpoint, "--max-model-len", "128", *flags)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, tuned_checkpoint):
    srv = _serve(tmp_path_factory, tuned_checkpoint)
    yield srv
    assert srv.stop() == 0, srv.log


@pytest.fixture(scope="module")
def vllm_defaults_server(tmp_path_factory, tuned_checkpoint):
    srv = _serve(tmp_path_factory, tuned_checkpoint, "--generation-config", "vllm",
                 "--max-tokens-default", "5")
    yield srv
    assert srv.stop() == 0, srv.log


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"ignore_eos": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _distinct_texts(server, **fields) -> int:
    body = _post(server, "/v1/chat/completions", {"messages": USER, "n": 4, "max_tokens": 8,
                                                  **fields})
    return len({c["message"]["content"] for c in body["choices"]})


def test_generation_config_sets_the_defaults(auto_server):
    chat = _post(auto_server, "/v1/chat/completions", {"messages": USER})
    assert chat["usage"]["completion_tokens"] == 3              # max_new_tokens
    assert chat["choices"][0]["finish_reason"] == "length"
    completion = _post(auto_server, "/v1/completions", {"prompt": "Hello"})
    assert completion["usage"]["completion_tokens"] == 3
    assert _distinct_texts(auto_server) == 1                     # temperature 0: greedy
    assert "generation_config.json" in auto_server.log and "temperature" in auto_server.log


def test_the_request_overrides_the_generation_config(auto_server):
    chat = _post(auto_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 6})
    assert chat["usage"]["completion_tokens"] == 6
    assert _distinct_texts(auto_server, temperature=1.0, top_p=1.0) > 1


def test_generation_config_vllm_ignores_it_and_max_tokens_default_applies(
        vllm_defaults_server):
    chat = _post(vllm_defaults_server, "/v1/chat/completions", {"messages": USER})
    assert chat["usage"]["completion_tokens"] == 5
    completion = _post(vllm_defaults_server, "/v1/completions", {"prompt": "Hello"})
    assert completion["usage"]["completion_tokens"] == 5
    assert _distinct_texts(vllm_defaults_server) > 1             # temperature 1, vLLM's
    chat = _post(vllm_defaults_server, "/v1/chat/completions",
                 {"messages": USER, "max_completion_tokens": 2})
    assert chat["usage"]["completion_tokens"] == 2


def test_without_any_default_chat_runs_to_the_end_of_the_context(tmp_path_factory,
                                                                 tiny_checkpoint):
    srv = _serve(tmp_path_factory, tiny_checkpoint("llama"))
    try:
        chat = _post(srv, "/v1/chat/completions", {"messages": USER})
        prompt = chat["usage"]["prompt_tokens"]
        assert chat["usage"]["completion_tokens"] == 128 - prompt   # as vLLM does
        # The legacy completions endpoint keeps OpenAI's (and vLLM's) 16.
        assert _post(srv, "/v1/completions", {"prompt": "Hi"})["usage"]["completion_tokens"] == 16
    finally:
        assert srv.stop() == 0, srv.log
