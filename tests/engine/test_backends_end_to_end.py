"""The engine with each attention backend forced gives transformers' greedy tokens (CPU).

TRITON_ATTN runs through Triton's interpreter, which must be switched on before triton
is imported, so it runs in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from archserve import LLM, SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 1 2 3"]


def hf_greedy(path: str, prompts: list[str], num_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                                 pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path = tiny_checkpoint("qwen2-h64")
    return path, hf_greedy(path, PROMPTS, 12)


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TORCH_REFERENCE", "FLEX_ATTENTION"])
def test_forced_backend_matches_transformers(reference, backend):
    path, expected = reference
    # chunked prefill; float32, as the transformers reference
    llm = LLM(path, attention_backend=backend, max_num_batched_tokens=16, dtype="float32")
    assert llm.llm_engine.report.attention.name == backend
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


CHILD = r"""
import json, sys
from archserve import LLM, SamplingParams
llm = LLM(sys.argv[1], attention_backend="TRITON_ATTN", max_num_batched_tokens=16,
          dtype="float32")
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=12,
                                                            ignore_eos=True))
print(json.dumps({"backend": llm.llm_engine.report.attention.name,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def test_triton_backend_under_the_interpreter_matches_transformers(reference):
    path, expected = reference
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(PROMPTS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "TRITON_ATTN"
    assert result["tokens"] == expected
