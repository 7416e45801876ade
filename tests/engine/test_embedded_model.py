"""The embedded SmolLM2-135M-Instruct GGUF through the whole engine, against transformers
loaded from the same file: greedy chat replies are identical and read as English."""

from __future__ import annotations

import re

import pytest
import torch

from archserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "Name three colors.",
         "Write one sentence about the sea."]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def llm(embedded_model_path):
    # float32: compared with transformers' float32 run of the same file
    return LLM(embedded_model_path, max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(llm):
    from archserve.loader.default_model import default_model_path
    from archserve.loader.transformers_gguf import transformers_model_from_gguf
    return transformers_model_from_gguf(default_model_path(),
                                        llm.llm_engine.model_config.hf_config)


def test_greedy_chat_matches_transformers_and_is_english(llm, hf_model):
    from archserve.loader.tokenizer import apply_chat_template
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    outputs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
    for chat, out in zip(CHATS, outputs, strict=True):
        ids = apply_chat_template(tok, [{"role": "user", "content": chat}])
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS,
                                    do_sample=False, eos_token_id=2, pad_token_id=2)
        ref_tokens = ref[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == ref_tokens[:len(got)] and (len(got) == len(ref_tokens)
                                                   or out.outputs[0].finish_reason == "stop")
        text = out.outputs[0].text
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 3, text
    assert "Paris" in outputs[0].outputs[0].text


def test_cpu_threads_do_not_spin_unless_the_user_says_so():
    """KMP_BLOCKTIME=0 is set before torch starts its OpenMP runtime (spinning workers
    made a decode step 6x slower on a busy machine); a value the user set is kept."""
    import os
    import subprocess
    import sys
    code = "import os, archserve, torch; print(os.environ['KMP_BLOCKTIME'])"
    env = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "0"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "KMP_BLOCKTIME": "50"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "50"
