"""Bad inputs to the loader fail with a ValueError that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from models.helpers import tiny_hf_model

from archserve.loader.loader import load_model
from archserve.models.registry import MODEL_REGISTRY


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", tie_word_embeddings=False).save_pretrained(path)
    return path


def _copy(src, dst):
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/model", torch.float32)


def test_corrupt_safetensors_names_the_file(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(path), torch.float32)


def test_truncated_safetensors(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(path), torch.float32)


def test_sharded_index_with_missing_shard(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_model(str(path), torch.float32)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad), torch.float32)


def test_unknown_architecture_lists_supported(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    _edit_config(path, architectures=["FancyForCausalLM"])
    with pytest.raises(ValueError, match="FancyForCausalLM") as info:
        load_model(str(path), torch.float32)
    for name in MODEL_REGISTRY:
        assert name in str(info.value)


def test_config_that_does_not_match_weights(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    _edit_config(path, intermediate_size=128)
    with pytest.raises(ValueError, match=r"shape mismatch: .*mlp\.gate_proj\.weight"):
        load_model(str(path), torch.float32)


def test_config_with_more_layers_than_weights(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    _edit_config(path, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"missing: .*model\.layers\.2\."):
        load_model(str(path), torch.float32)


def test_untied_config_on_checkpoint_without_lm_head(tmp_path):
    tiny_hf_model("qwen3", tie_word_embeddings=True).save_pretrained(tmp_path)
    _edit_config(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"missing: lm_head\.weight"):
        load_model(str(tmp_path), torch.float32)


def test_bad_load_format(saved_llama):
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(saved_llama), torch.float32, load_format="pickle")
    with pytest.raises(ValueError, match="no .gguf"):
        load_model(str(saved_llama), torch.float32, load_format="gguf")
