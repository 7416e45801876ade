"""The whole engine against Hugging Face transformers on tiny random models (fp32, CPU).

Greedy tokens must be identical for 32 tokens and top-5 logprobs within 1e-4, for a batch
of prompts of different lengths, whatever the batching features in play.
"""

from __future__ import annotations

import pytest
import torch

from archserve import LLM, SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks. Continuous"]
NUM_TOKENS = 32


def hf_greedy(path: str, prompt_ids: list[int], num_tokens: int):
    """transformers' greedy continuation and per-step log-softmax of its logits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # like ignore_eos: EOS may be generated
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens,
                             do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, logprobs


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def engine_and_reference(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    llm = LLM(path, max_num_seqs=8, dtype="float32")   # as the transformers reference
    tok = llm.get_tokenizer()
    reference = [hf_greedy(path, tok.encode(p), NUM_TOKENS) for p in PROMPTS]
    return llm, reference


def test_greedy_tokens_and_logprobs_match_transformers(engine_and_reference):
    llm, reference = engine_and_reference
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(PROMPTS, params)
    for out, (ref_tokens, ref_logprobs) in zip(outputs, reference, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens
        assert completion.finish_reason == "length"
        for step, entry in enumerate(completion.logprobs):
            top5 = torch.topk(ref_logprobs[step], 5)
            for value, token in zip(top5.values.tolist(), top5.indices.tolist(), strict=True):
                assert token in entry, f"step {step}: top-5 token {token} missing"
                assert abs(entry[token].logprob - value) < 1e-4
            sampled = completion.token_ids[step]
            assert entry[sampled].rank == 1


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=5),
    dict(enable_chunked_prefill=False),
    dict(num_kv_blocks=24, block_size=4, max_model_len=64),  # forces preemption
    dict(max_num_seqs=1),
], ids=["no-prefix-cache", "chunked-5", "no-chunking", "tiny-pool", "one-at-a-time"])
def test_batching_features_do_not_change_greedy_output(tiny_checkpoint, options):
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    baseline = [o.outputs[0].token_ids for o in LLM(path).generate(PROMPTS, params)]
    llm = LLM(path, **options)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == baseline
    assert llm.llm_engine.block_pool.num_used_blocks == 0


def test_preemption_really_happens_with_a_tiny_pool(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), num_kv_blocks=24, block_size=4, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = llm.llm_engine
    for p in PROMPTS:
        engine.add_request(None, p, params)
    preempted = 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        preempted += len(out.preempted)
        # Run the step the scheduler planned, as LLMEngine.step would.
        host = engine.runner.execute(out.scheduled).wait()
        engine.scheduler.postprocess(out, host.sampled_token_ids.tolist() if host else [])
    assert preempted > 0


def test_shared_prefix_hits_the_prefix_cache(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), block_size=4)
    prefix = "A paged KV cache stores keys and values in fixed-size blocks. "
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([prefix + "One"], params)
    out = llm.generate([prefix + "Two"], params)[0]
    assert out.num_cached_tokens >= 8


def test_n_greater_than_one_and_seeds(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    first = llm.generate(["Hello world"], params)[0]
    assert len(first.outputs) == 3
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the samples differ
    # The same seed gives the same samples, even batched with other requests.
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    again = llm.generate(["Once upon", "Hello world", "1 2 3"], [other, params, other])[1]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_stop_strings_and_stop_tokens(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Hello world"], greedy)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    index = full.text.find(stop)
    cut = llm.generate(["Hello world"], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[:index]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    token = full.token_ids[5]
    by_token = llm.generate(["Hello world"], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[token]))[0].outputs[0]
    assert by_token.token_ids == full.token_ids[:full.token_ids.index(token) + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token


def test_token_id_prompts_and_prompt_logprobs(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32")   # as the transformers reference
    ids = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_token_ids == ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        assert abs(out.prompt_logprobs[pos][ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4


def test_prompt_logprobs_are_complete_even_when_the_prefix_is_cached(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), block_size=4)
    prompt = "A paged KV cache stores keys and values in fixed-size blocks."
    llm.generate([prompt], SamplingParams(max_tokens=2))           # fills the prefix cache
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


def test_prompt_logprobs_with_n_siblings_and_chunked_prefill(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), max_num_batched_tokens=7)
    prompt = "A paged KV cache stores keys and values in fixed-size blocks."
    one = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    two = llm.generate([prompt], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1,
                                                temperature=1.0, seed=0))[0]
    assert len(two.prompt_logprobs) == len(two.prompt_token_ids)
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
