"""A JSON schema whose references recurse with no way out is found before compiling (no
finite value matches it); recursion with a way out is left alone."""

from __future__ import annotations

import pytest

from archserve.structured.schema_recursion import no_finite_instance

NODE = {"type": "object", "properties": {"kid": {"$ref": "#/$defs/node"}}, "required": ["kid"]}


@pytest.mark.parametrize("schema, cycle", [
    ({"$ref": "#"}, "# -> #"),
    ({"allOf": [{"$ref": "#"}]}, "# -> #/allOf/0 -> #"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "# -> #/items -> #"),
    ({"$defs": {"node": NODE}, "type": "object", "required": ["root"],
      "properties": {"root": {"$ref": "#/$defs/node"}}},
     "#/$defs/node -> #/$defs/node/properties/kid -> #/$defs/node"),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#"}}},
     "# -> #/anyOf/0 -> #"),
])
def test_recursion_with_no_way_out_is_named(schema, cycle: str) -> None:
    reason = no_finite_instance(schema)
    assert reason is not None and f"({cycle})" in reason, reason


@pytest.mark.parametrize("schema", [
    True, {}, {"type": "string"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},               # optional
    {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},                         # a way out
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "array", "items": {"$ref": "#"}},                               # [] ends it
    {"$defs": {"node": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"],
     "enum": [{"next": None}]},
    {"$ref": "https://example.com/elsewhere.json"},   # not followed: the compiler's question
])
def test_recursion_with_a_way_out_passes(schema) -> None:
    assert no_finite_instance(schema) is None


def test_a_false_schema_that_must_be_met_is_named() -> None:
    reason = no_finite_instance({"type": "object", "properties": {"x": False},
                                 "required": ["x"]})
    assert reason is not None and "`false`" in reason

