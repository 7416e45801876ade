"""LoRA adapters on a CUDA GPU with CUDA graphs (decode and mixed steps), against
transformers + peft on the same GPU.

Kernels sum in other orders than transformers, so the check scores *our* continuation, as
test_gpu_engine.py does: peft's model runs one forward over prompt + our tokens, and at
every step our logprob of our token must match its within the dtype's tolerance, and our
token must be its argmax up to a near-tie. Every row of a batch that mixes four adapters
and the base model, in bf16 and fp32; each adapter alone (batch 1); and with fewer slots
than adapters, so slots are refilled between graph replays.
"""

from __future__ import annotations

import pytest
import torch
from lora_adapters import ALL_LINEARS, peft_model, save_peft_adapter

from archserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3 4 5 6 7", "A paged KV cache stores keys and values in fixed-size blocks."]
NUM_TOKENS = 16
ADAPTERS = {
    "all_r16": dict(target_modules=ALL_LINEARS, r=16, lora_alpha=32, seed=1),
    "qv_r8": dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16, seed=2),
    "mlp_rslora": dict(target_modules=["gate_proj", "up_proj", "down_proj"], r=16,
                       lora_alpha=8, use_rslora=True, seed=3),
    "o_r4": dict(target_modules=["o_proj"], r=4, lora_alpha=8, seed=4),
}
# (logprob tolerance, near-tie): bf16 logits of a 2-layer model differ by ~0.01-0.05.
TOLERANCES = {"bfloat16": (0.1, 0.1), "float32": (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama-h64")     # head size 64: decode and mixed steps in graphs
    root = tmp_path_factory.mktemp("gpu-adapters")
    requests = {name: LoRARequest(name, i + 1, save_peft_adapter(base, str(root / name), **kw))
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    return base, requests


def assert_rows_match_peft(base: str, outputs, requests: list, dtype: str) -> None:
    tolerance, near_tie = TOLERANCES[dtype]
    models: dict = {}
    for out, request in zip(outputs, requests, strict=True):
        key = None if request is None else request.lora_name
        if key not in models:
            models[key] = peft_model(base, None if request is None else request.lora_path,
                                     getattr(torch, dtype), "cuda")
        completion = out.outputs[0]
        ids = list(out.prompt_token_ids) + list(completion.token_ids)
        with torch.no_grad():
            logits = models[key](input_ids=torch.tensor([ids], device="cuda")).logits[0]
        reference = torch.log_softmax(logits.float(), -1).cpu()
        first = len(out.prompt_token_ids) - 1
        for step, token in enumerate(completion.token_ids):
            row = reference[first + step]
            ours = completion.logprobs[step][token].logprob
            assert abs(ours - row[token].item()) < tolerance, (key, step)
            assert row.max().item() - row[token].item() < near_tie, (key, step)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_mixed_batch_in_cuda_graphs_matches_peft(setup, dtype):
    base, adapters = setup
    # TRITON_ATTN: steps with prompt tokens replay graphs too (cudagraph_mode FULL).
    llm = LLM(base, dtype=dtype, enable_lora=True, max_loras=4, max_lora_rank=16,
              attention_backend="TRITON_ATTN", kv_cache_memory_bytes=1 << 28,
              max_num_seqs=32, self_check=False)
    report = llm.llm_engine.report
    assert report.graph_sizes, f"no decode graph captured: {report.graph_demoted}"
    assert [r.backend for r in report.routes if r.op == "lora"] == ["TRITON_LORA"]
    assert any(d.what == "cudagraph_mode" and d.chosen == "FULL" for d in report.decisions)
    choices = [*adapters.values(), None]
    requests = [a for _ in PROMPTS for a in choices]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=1)
    outputs = llm.generate([p for p in PROMPTS for _ in choices], params,
                           lora_request=requests)
    assert_rows_match_peft(base, outputs, requests, dtype)


def test_one_request_at_a_time_in_cuda_graphs_matches_peft(setup):
    """Batch 1 (a decode graph of one row): the gate/up layer's activation runs in the
    LoRA expand (TRITON_LORA's ``add_lora_silu_mul``), for each adapter and the base."""
    base, adapters = setup
    llm = LLM(base, dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=16,
              kv_cache_memory_bytes=1 << 28, max_num_seqs=32, self_check=False)
    assert llm.llm_engine.report.graph_sizes
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=1)
    requests = [*adapters.values(), None]
    outputs = [llm.generate([PROMPTS[i % len(PROMPTS)]], params, lora_request=request)[0]
               for i, request in enumerate(requests)]
    assert_rows_match_peft(base, outputs, requests, "bfloat16")


def test_slots_refilled_between_graph_replays(setup):
    """Two slots, four adapters: the scheduler holds two at once and later requests take
    slots freed by earlier ones, while decode graphs replay over the same slot buffers."""
    base, adapters = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory_bytes=1 << 28, max_num_seqs=32, self_check=False)
    requests = [a for a in adapters.values() for _ in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=1)
    outputs = llm.generate(PROMPTS[:2] * len(adapters), params, lora_request=requests)
    assert llm.llm_engine.lora.slot_loads >= len(adapters)
    assert_rows_match_peft(base, outputs, requests, "float32")
