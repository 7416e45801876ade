"""Where archserve keeps what it pays for once: derived model files, measured ceilings,
compiled and autotuned kernels. ``$ARCHSERVE_CACHE_DIR`` wins, else ``$XDG_CACHE_HOME/archserve``,
else ``~/.cache/archserve``."""

from __future__ import annotations

import os


def cache_dir(*parts: str) -> str:
    base = os.environ.get("ARCHSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "archserve")
    return os.path.join(base, *parts)
