"""Reading a model's configuration from disk: config.json, generation_config.json, GGUF
metadata. What is read becomes a ModelConfig (archserve.models.config)."""

from __future__ import annotations

import json
import os
from typing import Any

from archserve.models.config import ModelConfig


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json as a dict (empty when absent); its eos ids win over config's."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def load_hf_model_config(model_dir: str) -> ModelConfig:
    """ModelConfig from a local HF directory (config.json + optional generation_config.json)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir}: no config.json, so this is not a Hugging Face model "
                         "directory")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{model_dir}/config.json could not be read: {exc}") from exc
    return ModelConfig.from_hf_config(hf_config, read_generation_config(model_dir))


def load_gguf_model_config(gguf_path: str) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata, through transformers' GGUF support."""
    from archserve.loader.gguf_cache import gguf_hf_config

    try:
        hf_config = gguf_hf_config(os.path.abspath(gguf_path))
    except Exception as exc:  # the gguf reader raises bare ValueError/struct/numpy errors
        raise ValueError(f"{gguf_path}: cannot read GGUF metadata ({type(exc).__name__}: "
                         f"{exc})") from exc
    return ModelConfig.from_hf_config(hf_config)
