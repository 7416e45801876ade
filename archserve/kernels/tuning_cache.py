"""A JSON file of tuning results, versioned and written atomically (one place for the
start-up tuners' caches: the dense decode GEMMs, the quantized ones and the MoE tiles).
Each entry is a dataclass instance, stored as its fields."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, TypeVar

log = logging.getLogger(__name__)
Entry = TypeVar("Entry")


def read_cache(path: str | None, version: int, section: str, entry_type: type[Entry]
               ) -> dict[str, Entry]:
    """``section`` of the file at ``path``, each entry an ``entry_type``; {} when absent, of
    another version or unreadable, or when an entry has other fields (tune again)."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != version:
            return {}
        return {key: entry_type(**fields) for key, fields in data[section].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("ignoring unreadable tuning cache %s (%s)", path, exc)
        return {}


def write_cache(path: str, version: int, section: str, entries: dict[str, Any]) -> None:
    """``entries`` (dataclass instances) as ``section`` of the file at ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fields = {key: vars(entry) for key, entry in sorted(entries.items())}
    with open(tmp, "w") as f:
        json.dump({"version": version, section: fields}, f, indent=1)
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
