"""Sampling defaults for the fields a request leaves unset, as vLLM's ``--generation-config``.

``auto`` takes them from the checkpoint's generation_config.json (what the model's authors
recommend), ``vllm`` ignores that file (vLLM's and OpenAI's own defaults), and a folder
reads the generation_config.json in it.
"""

from __future__ import annotations

import os
from typing import Any

from archserve.engine.sampling_params import SamplingParams

# The keys vLLM reads from generation_config.json; max_new_tokens becomes max_tokens.
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                          "max_new_tokens")


def load_generation_defaults(source: str, model: str | None) -> dict[str, Any]:
    """{sampling field: default}; ValueError when the source is missing or its values invalid."""
    from archserve.loader.config import read_generation_config

    if source == "vllm":
        return {}
    folder = model if source == "auto" else source
    if folder is None or not os.path.isdir(folder):
        if source == "auto":
            return {}   # the embedded model or a GGUF file: no generation_config.json
        raise ValueError(f"--generation-config {source}: not a directory")
    config = read_generation_config(folder)
    defaults = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:   # a bad default would turn every request that relies on it into a 400
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{folder}/generation_config.json: {exc}") from None
    return defaults
