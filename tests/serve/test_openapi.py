"""/openapi.json describes the real bodies, and a schema-driven fuzzer agrees with it.

Schemathesis reads the served schema and sends bodies that conform to it and bodies
that do not; every response must have a documented status, that status's content type
and schema, and no response may be a 5xx.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTES = {"/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get",
          "/v1/models/{model_id}": "get", "/health": "get", "/version": "get",
          "/metrics": "get", "/tokenize": "post", "/detokenize": "post",
          "/v1/load_lora_adapter": "post", "/v1/unload_lora_adapter": "post"}


def test_openapi_json_and_docs_are_served(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert {path: next(iter(ops)) for path, ops in schema["paths"].items()} == ROUTES
    components = schema["components"]["schemas"]
    assert components["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "user", "assistant", "tool", "developer"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    responses = chat["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "500", "503"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "413"):
        error = responses[status]["content"]["application/json"]["schema"]
        assert error["$ref"].endswith("/ErrorResponse")
    # Invalid bodies are 400s here, never FastAPI's 422.
    assert all("422" not in ops[method]["responses"]
               for ops in schema["paths"].values() for method in ops)
    assert "HTTPValidationError" not in components
    docs = httpx.get(f"{server.url}/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(case) -> None:
    """Keep each accepted generation request a few tokens long: the fuzzer looks for wrong
    statuses and shapes, and 64 choices of 500 tokens each would only spend CPU time."""
    body = case.body
    if (case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE
            or not isinstance(body, dict)
            or case.path not in ("/v1/completions", "/v1/chat/completions")):
        return   # a schema-violating body must stay as the fuzzer made it (and gets a 400)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    for field, most in (("max_tokens", 1), ("max_completion_tokens", 1), ("n", 2),
                        ("best_of", 2), ("min_tokens", 0)):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            body[field] = most


@schema.parametrize()
@settings(max_examples=20, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_5xx_and_no_undocumented_response(case, server):
    _bounded(case)
    case.call_and_validate(
        base_url=server.url, headers=AUTH, timeout=120,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                response_schema_conformance, negative_data_rejection])


def test_healthy_after_schemathesis(server):
    from tests.serve.conftest import wait_idle
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert wait_idle(server.url)["archserve:kv_cache_used_blocks"] == 0
