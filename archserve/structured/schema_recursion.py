"""Whether a JSON schema has any finite instance, and if not, the reference cycle to blame.

A schema can recurse with no way out: ``{"$ref": "#"}``, two ``$defs`` that refer to each
other, or an object whose required property is the object again. The grammar compiled
from such a schema matches no finite text, so a constrained request would generate nothing
valid (an empty answer, or nesting until max_tokens). This finds them before compiling.

A schema node is *finite* when some finite JSON value can satisfy what the grammar
generates for it: its ``$ref`` target, every ``allOf`` member and one ``anyOf`` /
``oneOf`` member are finite, and so is its own shape: an object's required properties
(those it declares: the grammar writes only those), an array's first ``minItems`` items.
Scalars, enums and constants always are. The finite nodes are the least fixed point of
that rule, found by iterating from "none" until nothing changes.
"""

from __future__ import annotations

from typing import Any

# Keywords whose members are subschemas: one schema, a list of them, or a name -> schema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


class _Schema:
    """Every subschema of a document by its JSON pointer, and local ``$ref`` resolution."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.pointers: dict[int, str] = {}
        self.nodes: list[Any] = []
        self._walk(root, "#")

    def _walk(self, node: Any, pointer: str) -> None:
        if not isinstance(node, (dict, bool)) or id(node) in self.pointers:
            return
        if isinstance(node, dict):   # booleans are shared objects: no pointer of their own
            self.pointers[id(node)] = pointer
        self.nodes.append(node)
        if not isinstance(node, dict):
            return
        for key in _ONE:
            self._walk(node.get(key), f"{pointer}/{key}")
        for key in _LIST:
            members = node.get(key)
            for i, member in enumerate(members if isinstance(members, list) else []):
                self._walk(member, f"{pointer}/{key}/{i}")
        for key in _MAP:
            members = node.get(key)
            for name, member in (members.items() if isinstance(members, dict) else ()):
                self._walk(member, f"{pointer}/{key}/{_escape(str(name))}")

    def resolve(self, ref: Any) -> Any:
        """The node a local ``$ref`` names; None for one this check cannot follow."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def pointer(self, node: Any) -> str:
        return self.pointers.get(id(node), str(node).lower())


def _needs(schema: _Schema, node: Any) -> list[list[list[Any]]]:
    """What ``node`` needs to be finite: every group has an alternative whose nodes are all
    finite (a group per $ref, allOf member, anyOf, oneOf and the node's own shape)."""
    if node is True or node is False:
        return [] if node else [[]]
    groups: list[list[list[Any]]] = []
    if "$ref" in node:
        target = schema.resolve(node["$ref"])
        if target is not None:
            groups.append([[target]])
    groups += [[[m]] for m in _members(node, "allOf")]
    groups += [[[m] for m in _members(node, key)] for key in ("anyOf", "oneOf")
               if _members(node, key)]
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None:   # the grammar infers the shape from the keywords, as xgrammar does
        if "properties" in node or "required" in node:
            types = ["object"]
        elif "items" in node or "prefixItems" in node:
            types = ["array"]
    # A scalar type, an enum or a constant is a finite value of its own.
    if types and "enum" not in node and "const" not in node and set(types) <= {"object",
                                                                            "array"}:
        groups.append([_object_needs(node) if kind == "object" else _array_needs(node)
                       for kind in types])
    return groups


def _members(node: dict, key: str) -> list[Any]:
    members = node.get(key)
    return [m for m in members if isinstance(m, (dict, bool))] if isinstance(members,
                                                                              list) else []


def _object_needs(node: dict) -> list[Any]:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return [properties[name] for name in required
            if isinstance(name, str) and isinstance(properties.get(name), (dict, bool))]


def _array_needs(node: dict) -> list[Any]:
    needed = node.get("minItems", 0)
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    if not isinstance(needed, int) or needed <= 0:
        return []
    # Items past the prefix all have one schema: one of them stands for all.
    wanted = prefix[:needed] + ([items] if needed > len(prefix) else [])
    return [m for m in wanted if isinstance(m, (dict, bool))]


def no_finite_instance(root: Any) -> str | None:
    """Why no finite JSON value satisfies ``root`` (the references that recurse with no way
    out, or the ``false`` schema that cannot be met), or None when one does."""
    schema = _Schema(root)
    finite: set[int] = set()

    def is_finite(node: Any) -> bool:
        if node is True:
            return True
        if node is False:
            return False
        return id(node) in finite or id(node) not in schema.pointers

    def meets(groups: list[list[list[Any]]]) -> bool:
        return all(any(all(map(is_finite, alt)) for alt in group) for group in groups)

    changed = True
    while changed:
        changed = False
        for node in schema.nodes:
            if isinstance(node, dict) and id(node) not in finite and meets(
                    _needs(schema, node)):
                finite.add(id(node))
                changed = True
    if is_finite(root):
        return None
    # Every node that is not finite has a need that is not: follow them to a repeat.
    path: list[Any] = []
    node = root
    while isinstance(node, dict) and all(n is not node for n in path):
        path.append(node)
        failing = next(g for g in _needs(schema, node)
                       if not any(all(map(is_finite, alt)) for alt in g))
        node = next((n for alt in failing for n in alt if not is_finite(n)), False)
    if not isinstance(node, dict):
        where = " -> ".join(schema.pointer(n) for n in path) or "#"
        return f"the JSON schema has no valid value: {where} requires a value of a `false` schema"
    start = next(i for i, n in enumerate(path) if n is node)
    cycle = " -> ".join(schema.pointer(n) for n in [*path[start:], node])
    return (f"the JSON schema's references recurse with no way out ({cycle}): no finite "
            f"JSON value satisfies it; make the recursion optional (a property that is "
            f"not required, an anyOf with a non-recursive member)")
