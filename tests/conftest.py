import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# A CPU engine compiles its decode steps by default (engine/compilation_config.py), which
# costs seconds a start on 2 cores: tests build eager engines unless they test compiling
# (they pass compilation_config). Set in the environment, so that the servers and CLI
# processes tests start take it too.
os.environ.setdefault("ARCHSERVE_COMPILATION_LEVEL", "0")

from tiny_checkpoints import build_tiny_checkpoint  # noqa: E402

# variant name -> (transformers model_type, config overrides)
TINY_VARIANTS = {
    "llama": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
}
# Head size 64: the smallest that every attention backend's rules accept (GPU tests).
_H64 = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=1)
for _name in ("llama", "qwen2", "qwen3"):
    _type, _overrides = TINY_VARIANTS[_name]
    TINY_VARIANTS[f"{_name}-h64"] = (_type, {**_overrides, **_H64})
# 8 query heads: four tensor-parallel ranks of two query heads each, with one KV head
# per rank (kv4) or each KV head replicated on two ranks (kv2).
for _kv in (4, 2):
    TINY_VARIANTS[f"llama-8q{_kv}kv"] = ("llama", dict(num_attention_heads=8,
                                                      num_key_value_heads=_kv,
                                                      tie_word_embeddings=False))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant) -> path of a saved tiny random model with a tokenizer."""
    cache: dict[str, str] = {}

    def make(variant: str = "llama") -> str:
        if variant not in cache:
            model_type, overrides = TINY_VARIANTS[variant]
            path = str(tmp_path_factory.mktemp(f"tiny-{variant}"))
            cache[variant] = build_tiny_checkpoint(path, model_type, **overrides)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def embedded_model_path() -> str:
    """The embedded SmolLM2 GGUF. Without its package the test skips on a developer's
    machine, and fails in CI (``CI`` set, as .ci/run does), where a skip would hide that
    the README's install no longer brings the model."""
    from archserve.loader.default_model import default_model_path
    try:
        return default_model_path()
    except ValueError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have the embedded model: {exc}")
        pytest.skip(str(exc))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def free_gpu_memory_after_each_test():
    """An engine sizes its KV cache from the GPU memory free at start; an earlier test's
    engine, still held by a reference cycle or by torch's caching allocator, would leave
    the next one none. Only where there is a GPU: gc.collect per test costs the CPU run."""
    yield
    if torch.cuda.is_available():
        from archserve.engine.heap import free_dropped_engines
        free_dropped_engines("cuda")
