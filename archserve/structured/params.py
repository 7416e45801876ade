"""StructuredOutputsParams: what a request's output must match (vLLM's names).

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (EBNF, or a
Lark grammar), ``json_object`` (any JSON object) or ``structural_tag`` (xgrammar's
structural-tag JSON, what tool calling uses) is set. Only the shape is checked here;
whether the schema or grammar compiles is the compiler's question (``compiler.py``).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # JSON output with no whitespace between tokens (vLLM's name); otherwise a little
    # whitespace is allowed (never an unbounded run: small models loop on newlines).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise ValueError("structured_outputs needs one of " + ", ".join(KINDS))

    def validate(self) -> None:
        """Raise ValueError naming the problem with the spec's shape."""
        given = [name for name in KINDS
                 if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of " + ", ".join(KINDS)
                             + (f"; got {', '.join(given)}" if given else "; got none"))
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{kind} is not valid JSON: "
                                     f"{exc}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"structured_outputs.{kind} must be a JSON object")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
        elif value is not True:
            raise ValueError("structured_outputs.json_object must be true")

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for specs that compile to the same grammar (dict key order aside)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag") and isinstance(value, str):
            value = _json.loads(value)
        if isinstance(value, (dict, bool)):
            text = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif isinstance(value, (list, tuple)):
            text = _json.dumps(list(value))
        else:
            text = str(value)
        return kind, text, self.disable_any_whitespace
