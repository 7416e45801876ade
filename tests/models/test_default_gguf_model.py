"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF: our loader + model against transformers'.

transformers dequantizes and renames the same file through its own code
(``load_gguf_checkpoint``), so agreement checks our GGUF name mapping, the undone q/k
permutation, tied embeddings and the decoder on a real model nobody here wrote.
"""

from __future__ import annotations

import pytest
import torch

from archserve.loader.loader import load_model
from archserve.loader.transformers_gguf import transformers_model_from_gguf
from models.helpers import PagedSequences, hf_last_logits

pytestmark = pytest.mark.slow  # ~20 s of CPU: two independent loads of a 135M model

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018, 411, 407, 19712,
          8182, 2]


@pytest.fixture(scope="module")
def models(embedded_model_path):
    path = embedded_model_path
    ours, config = load_model(path, dtype=torch.float32, device="cpu")
    # config.hf_config is exactly AutoConfig.from_pretrained(dir, gguf_file=name).
    return ours, config, transformers_model_from_gguf(path, config.hf_config)


def test_config_read_from_gguf(models):
    _, config, _ = models
    assert (config.architecture, config.num_layers, config.hidden_size) == (
        "LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == [2]


def test_prefill_and_decode_logits_match_transformers(models):
    ours, config, hf = models
    cache = PagedSequences.for_config(config, block_size=16)
    prefill = cache.run(ours, {0: PROMPT})[0]
    expected = hf_last_logits(hf, PROMPT)
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)
    next_token = int(prefill.argmax())
    assert next_token == int(expected.argmax())
    decode = cache.run(ours, {0: [next_token]})[0]
    torch.testing.assert_close(decode, hf_last_logits(hf, PROMPT + [next_token]),
                               atol=1e-4, rtol=1e-4)
