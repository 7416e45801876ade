"""GET /v1/models and /v1/models/{id}: one card per name the server answers to."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _cards(url: str, headers: dict) -> dict[str, dict]:
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


def _same_card(a: dict, b: dict) -> bool:
    # ``created`` is the time of the response, not a property of the model.
    return {**a, "created": 0} == {**b, "created": 0}


def test_retrieve_the_served_model(server):
    cards = _cards(server.url, AUTH)
    assert list(cards) == ["SmolLM2-135M-Instruct"]
    r = httpx.get(f"{server.url}/v1/models/SmolLM2-135M-Instruct", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert _same_card(card, cards["SmolLM2-135M-Instruct"])


def test_retrieve_through_the_openai_client(client):
    model = client.models.retrieve("SmolLM2-135M-Instruct")
    assert model.id == "SmolLM2-135M-Instruct" and model.object == "model"


@pytest.mark.parametrize("model_id", ["gpt-17", "SmolLM2-135M-Instruct-x", "a/b/c"])
def test_unknown_model_id_is_404(server, model_id):
    r = httpx.get(f"{server.url}/v1/models/{model_id}", headers=AUTH, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 404 and model_id in error["message"]


def test_retrieve_needs_the_api_key(server):
    r = httpx.get(f"{server.url}/v1/models/SmolLM2-135M-Instruct", timeout=30)
    assert r.status_code == 401


@pytest.fixture(scope="module")
def path_server(tmp_path_factory):
    """Served by --model PATH: it answers to the file's name and to the path itself."""
    from archserve.loader.default_model import default_model_path
    srv = start_server(tmp_path_factory.mktemp("serve-path") / "server.log",
                       "--model", default_model_path())
    yield srv
    assert srv.stop() == 0, srv.log


def test_every_alias_has_its_card(path_server):
    from archserve.loader.default_model import default_model_path
    path = default_model_path()
    cards = _cards(path_server.url, {})
    assert path in cards and len(cards) == 2        # the short name and the path
    for name, card in cards.items():
        # A path alias holds slashes; it is still one id, not more path segments.
        # (as the openai client sends it: ``/models/{id}``, so a path gives ``//``).
        r = httpx.get(f"{path_server.url}/v1/models/{name}", timeout=30)
        assert r.status_code == 200, (name, r.text)
        assert _same_card(r.json(), card)
