"""A JSON file of tuning results, versioned and written atomically (one place for the
start-up tuners' caches: the dense decode GEMMs and the quantized ones)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def read_cache(path: str | None, version: int, section: str) -> dict[str, dict[str, Any]]:
    """``section`` of the file at ``path``; {} when absent, of another version or unreadable."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != version:
            return {}
        return dict(data[section])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring unreadable tuning cache %s (%s)", path, exc)
        return {}


def write_cache(path: str, version: int, section: str, entries: dict[str, dict[str, Any]]
                ) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": version, section: dict(sorted(entries.items()))}, f, indent=1)
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
