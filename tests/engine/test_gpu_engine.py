"""The engine on a CUDA GPU in bf16 against transformers on the same GPU, graphs on and off.

bf16 rounding differs between implementations, so a near-tie can flip a greedy token and the
two greedy continuations then diverge. So the check scores *our* continuation: transformers
runs one forward pass over prompt + our generated tokens, and at every decode step (replayed
from a CUDA graph in the graphs run) our logprob of our token must match transformers' within
bf16 tolerance, and our token must be transformers' argmax up to a near-tie. Every prompt,
every step.
"""

from __future__ import annotations

import pytest
import torch

from archserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks. Continuous",
           "Once upon a time there was", "def main():", "The quick brown fox", "Ünïcödé façade"]
NUM_TOKENS = 16
LOGPROB_TOL = 0.1   # bf16 logits of a 2-layer model: observed differences are ~0.01-0.05
NEAR_TIE = 0.1      # our greedy token may lose to transformers' argmax by at most this


@pytest.fixture(scope="module", params=["llama-h64", "qwen2-h64", "qwen3-h64"])
def checkpoint_and_model(request, tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    yield path, model
    del model


def transformers_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids`` (fp32, on CPU)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0]
    return torch.log_softmax(logits.float(), -1).cpu()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", [None, "TORCH_SDPA", "FLEX_ATTENTION", "TORCH_REFERENCE"])
def test_bf16_decode_matches_transformers_on_every_prompt(checkpoint_and_model, enforce_eager,
                                                          backend):
    path, model = checkpoint_and_model
    llm = LLM(path, dtype="bfloat16", enforce_eager=enforce_eager, attention_backend=backend,
              kv_cache_memory_bytes=1 << 28, max_num_seqs=16,
              self_check=False)   # one test below covers it; 24 starts need not repeat it
    report = llm.llm_engine.report
    if enforce_eager:
        assert not report.graph_sizes
    elif report.attention.backend.graph_capturable:
        assert report.graph_sizes, f"no CUDA graph captured: {report.graph_demoted}"
    else:
        assert not report.graph_sizes and "host" in report.graphs_off
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                ignore_eos=True, logprobs=1))
    tok = llm.get_tokenizer()
    failures = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        prompt_ids = tok.encode(prompt)
        got = out.outputs[0].token_ids
        assert len(got) == NUM_TOKENS
        ref = transformers_logprobs(model, prompt_ids + got)
        for step, token in enumerate(got):
            row = ref[len(prompt_ids) + step - 1]   # the logits that chose token ``step``
            ours = out.outputs[0].logprobs[step][token].logprob
            theirs = row[token].item()
            if abs(ours - theirs) > LOGPROB_TOL or row.max().item() - theirs > NEAR_TIE:
                failures.append((prompt, step, token, ours, theirs, row.max().item()))
    assert not failures, failures


def test_default_backend_on_this_gpu_is_the_ideal_one(tiny_checkpoint):
    # The share of the card counts every process's memory (as vLLM's did): leave this engine
    # 4 GiB above what is in use, so kernel tests running beside it on the GPU do not matter.
    free, total = torch.cuda.mem_get_info()
    utilization = min(0.95, (total - free + (4 << 30)) / total)
    llm = LLM(tiny_checkpoint("llama-h64"), dtype="bfloat16",
              gpu_memory_utilization=utilization)
    assert llm.llm_engine.report.num_blocks > 1000  # sized by profiling, not a default
    sel = llm.llm_engine.report.attention
    # On an H200 with no flash_attn/flashinfer installed, our Triton kernels win.
    assert sel.name in ("TRITON_ATTN", sel.ideal)
    assert llm.llm_engine.report.graph_sizes and not llm.llm_engine.report.graph_demoted
    linear = next(r for r in llm.llm_engine.report.routes if r.op == "linear")
    assert linear.backend == "TRITON_SKINNY_GEMM"
    assert any(d.what == "decode GEMMs" for d in llm.llm_engine.report.decisions)
    check = llm.llm_engine.report.self_check
    assert check is not None and check.graphs and 0 < check.ratio
    # No CUDA profile at start-up unless asked (it would leave CUPTI on every launch).
    assert check.time_by_kind == {} and "not profiled" in check.summary()


def test_async_scheduling_on_the_gpu_equals_sync(tiny_checkpoint):
    """Pinned copies behind an event, placeholder inputs fed from the device, graphs on."""
    path = tiny_checkpoint("llama-h64")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in (1, 5, 16, 33, 9, 2, 20, 12)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(path, dtype="bfloat16", async_scheduling=async_scheduling,
                  kv_cache_memory_bytes=1 << 28, max_num_seqs=16, self_check=False)
        assert llm.llm_engine.report.graph_sizes
        outs = llm.generate(PROMPTS, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert llm.llm_engine.block_pool.num_used_blocks == 0
        del llm
    assert results[0] == results[1]


def test_no_prefill_kernel_is_tuned_on_the_serving_path(tiny_checkpoint):
    """Start-up warms every prefill tune bucket: prompts of any length then tune nothing."""
    from archserve.kernels.attention.triton_prefill import _tuned_prefill_kernel
    llm = LLM(tiny_checkpoint("llama-h64"), dtype="bfloat16", attention_backend="TRITON_ATTN",
              kv_cache_memory_bytes=1 << 28, self_check=False)
    assert llm.llm_engine.max_model_len == 256  # the tiny model's: two tune buckets
    tuned = dict(_tuned_prefill_kernel.cache)
    prompts = [{"prompt_token_ids": [7 + i % 50 for i in range(n)]} for n in (3, 20, 63, 129,
                                                                             250)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert dict(_tuned_prefill_kernel.cache) == tuned
