"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF: our loader + model against transformers'.

transformers dequantizes and renames the same file through its own code
(``load_gguf_checkpoint``), so agreement checks our GGUF name mapping, the undone q/k
permutation, tied embeddings and the decoder on a real model nobody here wrote.
"""

from __future__ import annotations

import pytest
import torch

from archserve.loader.default_model import default_model_path
from archserve.loader.loader import load_model
from models.helpers import PagedSequences, hf_last_logits

pytestmark = pytest.mark.slow  # ~20 s of CPU: two independent loads of a 135M model

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018, 411, 407, 19712,
          8182, 2]


class _ParametersOnly:
    """What transformers' GGUF name mapping reads from a model: config and parameter names.

    Handing it the full model makes it rebuild the name table for each of ~400 submodules
    (about 6 s); the names are the same either way.
    """

    def __init__(self, model) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self):
        return self._state

    def named_children(self):
        return iter(())


def _hf_model_from_gguf(path: str, hf_config):
    """transformers' own GGUF load (``from_pretrained(gguf_file=)`` minus ``accelerate``)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # no random init of weights we overwrite anyway
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True,
                                   model_to_load=_ParametersOnly(model))["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)  # buffers left on meta
    return model.eval()


@pytest.fixture(scope="module")
def models():
    try:
        path = default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    ours, config = load_model(path, dtype=torch.float32, device="cpu")
    # config.hf_config is exactly AutoConfig.from_pretrained(dir, gguf_file=name).
    return ours, config, _hf_model_from_gguf(path, config.hf_config)


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
