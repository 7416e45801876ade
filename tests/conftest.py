import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_checkpoints import build_tiny_checkpoint  # noqa: E402

TINY_MODEL_TYPES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type) -> path of a saved tiny random model with a tokenizer."""
    cache: dict[str, str] = {}

    def make(model_type: str = "llama") -> str:
        if model_type not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{model_type}"))
            cache[model_type] = build_tiny_checkpoint(path, model_type,
                                                      **TINY_MODEL_TYPES.get(model_type, {}))
        return cache[model_type]

    return make


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
