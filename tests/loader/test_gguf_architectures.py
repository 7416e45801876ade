"""GGUF files of other architectures than the embedded one, written here the way llama.cpp's
converter writes them: the engine gives the same tokens as from the safetensors original."""

from __future__ import annotations

import pytest
from tiny_checkpoints import build_tiny_checkpoint, write_tiny_gguf

from archserve import LLM, SamplingParams

PROMPT = "Hello world! The capital of France"


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", dict(tie_word_embeddings=False)),     # q/k rows permuted in the file
    ("qwen2", dict(tie_word_embeddings=True)),      # qkv biases, tied embeddings
    ("qwen3", dict(tie_word_embeddings=False)),     # q/k norms
])
def test_gguf_equals_safetensors(tmp_path, model_type, overrides):
    hf_dir = build_tiny_checkpoint(str(tmp_path / "hf"), model_type, **overrides)
    gguf_path = write_tiny_gguf(hf_dir, str(tmp_path / f"{model_type}.gguf"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from_gguf = LLM(gguf_path).generate([PROMPT], params)[0]
    from_hf = LLM(hf_dir).generate([PROMPT], params)[0]
    assert from_gguf.prompt_token_ids == from_hf.prompt_token_ids
    assert from_gguf.outputs[0].token_ids == from_hf.outputs[0].token_ids
