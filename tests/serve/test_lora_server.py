"""LoRA adapters through a real `archserve serve --enable-lora` process and the openai
client: each adapter is a model name in /v1/models; its completions are the offline
engine's; /v1/load_lora_adapter and /v1/unload_lora_adapter work at run time behind the
API key; a bad path, a rank above --max-lora-rank or a taken name is a 400 naming the
problem, and the server stays healthy and serving."""

from __future__ import annotations

import httpx
import pytest
from conftest import API_KEY, start_server
from lora_adapters import ALL_LINEARS, save_peft_adapter

from archserve import LLM, LoRARequest, SamplingParams

PROMPT = "The capital of France is Paris. The capital of"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("served-adapters")
    adapters = {
        "first": save_peft_adapter(base, str(root / "first"), ALL_LINEARS, r=8, seed=11),
        "second": save_peft_adapter(base, str(root / "second"), ["q_proj", "v_proj"], r=16,
                                    lora_alpha=32, seed=12),
        "rank32": save_peft_adapter(base, str(root / "rank32"), ["q_proj"], r=32, seed=13),
    }
    server = start_server(root / "server.log", "--model", base, "--api-key", API_KEY,
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                          "--lora-modules", f"first={adapters['first']}")
    yield base, adapters, server
    assert server.stop() == 0, server.log


def offline_texts(base: str, adapters: dict[str, str]) -> dict[str | None, str]:
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32")  # as served
    params = SamplingParams(temperature=0.0, max_tokens=12)
    return {name: llm.generate([PROMPT], params, lora_request=None if name is None else
                               LoRARequest(name, i + 1, adapters[name]))[0].outputs[0].text
            for i, name in enumerate([None, "first", "second"])}


def complete(server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                            "temperature": 0})


def post(server, route: str, body: dict, auth: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", headers=AUTH if auth else {}, json=body,
                      timeout=60)


def model_cards(server) -> dict[str, dict]:
    data = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    return {card["id"]: card for card in data}


def test_adapters_are_models_served_as_the_offline_engine_serves_them(setup):
    base, adapters, server = setup
    expected = offline_texts(base, adapters)
    cards = model_cards(server)
    base_name = next(name for name in cards if name != "first")
    assert cards["first"]["root"] == adapters["first"]
    assert cards["first"]["parent"] == base_name
    from openai import OpenAI
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    reply = client.completions.create(model="first", prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    assert reply.model == "first" and reply.choices[0].text == expected["first"]
    plain = client.completions.create(model=base_name, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    assert plain.choices[0].text == expected[None] != expected["first"]
    chat = client.chat.completions.create(model="first", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "first"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics

    # Loaded at run time: served at once, then gone when unloaded.
    loaded = post(server, "load_lora_adapter",
                  {"lora_name": "second", "lora_path": adapters["second"]})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'second' added successfully."
    assert "second" in model_cards(server)
    assert complete(server, "second").json()["choices"][0]["text"] == expected["second"]
    unloaded = post(server, "unload_lora_adapter", {"lora_name": "second"})
    assert unloaded.status_code == 200, unloaded.text
    assert "second" not in model_cards(server)
    assert complete(server, "second").status_code == 404
    assert post(server, "unload_lora_adapter", {"lora_name": "second"}).status_code == 404


def test_bad_loads_are_400s_and_the_server_stays_healthy(setup, tmp_path):
    base, adapters, server = setup
    base_name = next(name for name in model_cards(server) if name != "first")
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "no such directory"),
        ({"lora_name": "x", "lora_path": adapters["rank32"]},
         "LoRA rank 32 is greater than max_lora_rank 16"),
        ({"lora_name": "first", "lora_path": adapters["second"]}, "has already been loaded"),
        ({"lora_name": base_name, "lora_path": adapters["second"]}, "base model's name"),
        ({"lora_name": "", "lora_path": adapters["second"]}, "must be provided"),
    ]
    for body, message in cases:
        response = post(server, "load_lora_adapter", body)
        assert response.status_code == 400, (body, response.text)
        assert message in response.json()["error"]["message"], response.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert {n for n, card in model_cards(server).items() if card["parent"]} == {"first"}
    assert post(server, "load_lora_adapter", {"lora_name": "y", "lora_path": "x"},
                auth=False).status_code == 401
    assert post(server, "unload_lora_adapter", {"lora_name": "first"},
                auth=False).status_code == 401
    assert complete(server, "first").status_code == 200
    assert complete(server, "no-such-model").status_code == 404


def test_lora_endpoints_without_enable_lora_are_400s(server):
    """The shared server (no --enable-lora): loading is refused with the reason."""
    response = post(server, "load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
    assert response.status_code == 400
    assert "--enable-lora" in response.json()["error"]["message"]


def test_serve_takes_lora_flags_as_vllm_does(monkeypatch):
    """Several adapters after one --lora-modules (vLLM's nargs), the flag repeated, or
    vLLM's JSON form; the engine gets the LoRA fields."""
    from typer.testing import CliRunner

    import archserve.serve.launcher as launcher
    from archserve.cli.main import app

    started = {}
    monkeypatch.setattr(launcher, "run_server",
                        lambda config, settings: started.update(config=config, settings=settings))
    args = ["serve", "--enable-lora", "--lora-modules", "a=/p", "b=/q", "--max-loras", "3",
            "--lora-modules", '{"name": "c", "path": "/r", "base_model_name": "m"}',
            "--max-lora-rank", "64", "--max-cpu-loras", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    modules = started["settings"].lora_modules
    assert [(m.name, m.path, m.base_model_name) for m in modules] == [
        ("a", "/p", None), ("c", "/r", "m"), ("b", "/q", None)]
    config = started["config"]
    assert (config.enable_lora, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras) == (True, 3, 64, 8)
    for bad, message in ((["serve", "--lora-modules", "a=/p"], "needs --enable-lora"),
                         (["serve", "--enable-lora", "--lora-modules", "nopath"],
                          "expected name=path"),
                         (["serve", "stray"], "unexpected argument")):
        result = CliRunner().invoke(app, bad)
        text = " ".join(result.output.replace("│", " ").split())   # the error box, unwrapped
        assert result.exit_code == 2 and message in text, result.output
