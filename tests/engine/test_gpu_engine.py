"""The engine on a CUDA GPU in bf16 against transformers on the same GPU, graphs on and off.

bf16 rounding differs between implementations, so a near-tie can flip a greedy token:
we require the first 16 tokens to agree on most prompts and the logprobs to stay close.
"""

from __future__ import annotations

import pytest
import torch

from archserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks. Continuous",
           "Once upon a time there was", "def main():", "The quick brown fox", "Ünïcödé façade"]


def hf_reference(path: str, tokenizer, num_tokens: int):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        refs.append((out.sequences[0, len(ids):].tolist(),
                     [torch.log_softmax(x[0].float(), -1).cpu() for x in out.logits]))
    return refs


@pytest.fixture(scope="module", params=["llama-h64", "qwen2-h64", "qwen3-h64"])
def checkpoint_and_reference(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return path, hf_reference(path, tok, 16)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", [None, "TORCH_SDPA", "FLEX_ATTENTION", "TORCH_REFERENCE"])
def test_bf16_greedy_close_to_transformers(checkpoint_and_reference, enforce_eager, backend):
    path, refs = checkpoint_and_reference
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
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True, logprobs=1))
    agree = 0
    for out, (ref_tokens, ref_lps) in zip(outs, refs, strict=True):
        got = out.outputs[0].token_ids
        agree += got == ref_tokens
        # Wherever the prefixes still agree, the chosen token's logprob is close.
        for step, (a, b) in enumerate(zip(got, ref_tokens, strict=True)):
            if a != b:
                break
            assert abs(out.outputs[0].logprobs[step][a].logprob - ref_lps[step][a].item()) < 0.1
    # "Most prompts": a strict majority (bf16 near-ties can flip a greedy token).
    assert agree > len(PROMPTS) // 2, f"only {agree}/{len(PROMPTS)} prompts agree"
    # Teacher-forced: score transformers' own continuation; every logprob stays close, so a
    # disagreement above is a near-tie, not a wrong kernel.
    tok = llm.get_tokenizer()
    forced = [tok.encode(p) + ref for p, (ref, _) in zip(PROMPTS, refs, strict=True)]
    scored = llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for out, prompt, (ref_tokens, ref_lps) in zip(scored, PROMPTS, refs, strict=True):
        start = len(tok.encode(prompt))
        for step, token in enumerate(ref_tokens):
            ours = out.prompt_logprobs[start + step][token].logprob
            assert abs(ours - ref_lps[step][token].item()) < 0.1, (prompt, step)


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
    assert set(check.time_by_kind) >= {"attention", "linear"}


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
