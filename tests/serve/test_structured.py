"""Structured output through a real `archserve serve` and the openai client: every
constrained answer parses and validates against its schema (hypothesis-generated schemas,
streaming and not), the request fields of OpenAI and vLLM, and bad schemas are a 400."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
NUM_SCHEMAS = 6

# Small, bounded schemas: every answer fits a few dozen tokens, so each ends by its
# grammar (finish_reason "stop"), never by max_tokens.
_LEAVES = st.sampled_from([
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "boolean"},
    {"type": "string", "maxLength": 6},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "null"},
])
_KEYS = st.sampled_from(["id", "name", "ok", "tags", "size", "note"])


def _object(children):
    return st.dictionaries(_KEYS, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


def _array(children):
    return children.map(lambda item: {"type": "array", "items": item, "minItems": 1,
                                      "maxItems": 2})


SCHEMAS = _object(st.recursive(_LEAVES, lambda c: _object(c) | _array(c), max_leaves=3))


def _chat(client, schema, i: int, stream: bool):
    """One constrained chat request; every other one through vLLM's field, compact JSON."""
    messages = [{"role": "user", "content": f"Reply with a JSON object ({i})."}]
    if i % 2:
        extra = {"extra_body": {"structured_outputs": {"json": schema,
                                                       "disable_any_whitespace": True}}}
    else:
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": schema, "strict": True}}}
    kwargs = dict(model=MODEL, messages=messages, max_tokens=160, temperature=0, **extra)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@settings(max_examples=1, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(SCHEMAS, min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS))
def test_generated_schemas_are_obeyed_streaming_and_not(client, schemas):
    """All schemas at once (one batch), half of them streamed."""
    with ThreadPoolExecutor(NUM_SCHEMAS) as pool:
        results = list(pool.map(lambda a: _chat(client, a[1], a[0], stream=a[0] % 3 == 0),
                                enumerate(schemas)))
    for schema, (text, reason) in zip(schemas, results, strict=True):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_regex_and_grammar_fields(client):
    """OpenAI's json_object, vLLM's structured_outputs and its older guided_* names, in
    chat and completions."""
    r = client.chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return exactly this JSON: {"ok": true}'}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [("Is water wet? Answer:", {"guided_choice": ["yes", "no"]},
              lambda t: t in ("yes", "no")),
             ("A date:", {"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
              lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
             ("Answer:", {"structured_outputs": {"grammar": 'root ::= "A" ("B" | "C")'}},
              lambda t: t in ("AB", "AC")),
             ('{"n": 3} is JSON. Another:', {"guided_json": {
                 "type": "object", "required": ["n"], "additionalProperties": False,
                 "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}},
              lambda t: 0 <= json.loads(t)["n"] <= 9)]
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: client.completions.create(
            model=MODEL, prompt=c[0], max_tokens=24, temperature=0, extra_body=c[1]), cases))
    for (_, body, ok), r in zip(cases, outs, strict=True):
        assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].text), (body, r)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "structured_outputs",
     "grammar"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}},
     "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
     "guided_choice", "one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    # Schemas whose references recurse with no way out: no finite JSON value matches them.
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "recurse with no way out (# -> #)"),
    ({"extra_body": {"structured_outputs": {"json": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a"}}}},
     "structured_outputs", "(#/$defs/a -> #/$defs/b -> #/$defs/a)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}},
     "response_format", "(# -> #/properties/next -> #)"),
])
def test_a_bad_constraint_is_a_400_naming_it(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}], **body)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error
    ok = client.chat.completions.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].finish_reason in ("length", "stop")   # the server serves on


def test_a_recursive_schema_with_a_way_out_is_obeyed(client):
    """A linked list whose `next` is optional recurses, and has finite values: it is not
    refused as a recursion with no way out. (The tiny model may nest until max_tokens.)"""
    schema = {"type": "object", "required": ["v"], "additionalProperties": False,
              "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                             "next": {"$ref": "#"}}}
    r = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "A short linked list as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "list", "schema": schema}})
    text = r.choices[0].message.content
    assert re.match(r'\{\s*"v":', text), text
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
