"""vLLM's JSON-valued engine options (compilation_config, speculative_config): the text
parsed, and keys archserve does not have refused by name rather than ignored."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def loads_option(value: Any, name: str) -> Any:
    """``value`` itself, or the JSON it holds where it is text (ValueError naming ``name``
    where that is not JSON)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None


def refuse_unknown_keys(value: dict, keys: Collection[str], name: str) -> None:
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{name} key(s) {', '.join(unknown)} not supported by archserve; "
                         f"supported: {', '.join(keys)}")
