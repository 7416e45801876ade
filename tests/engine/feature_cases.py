"""Requests that exercise what an engine change could break (greedy and seeded tokens, EOS
and stop strings, max_tokens and max_model_len, n > 1, logprobs, penalties, chunked
prefill, prefix caching, preemption by a tiny pool), each with the engine arguments it
needs: shared by the tests that compare two ways of running them."""

from __future__ import annotations

from archserve import SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks. Continuous",
           "Once upon a time", "def main():"]

CASES = {
    "greedy-lengths": (dict(), [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                for n in (1, 2, 7, 24, 3, 40)]),
    "eos-and-stops": (dict(), [SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "e"]),
                               SamplingParams(temperature=0.0, max_tokens=30),
                               SamplingParams(temperature=0.0, max_tokens=30,
                                              stop_token_ids=[5, 17, 40, 77]),
                               SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5,
                                              stop_token_ids=[5, 17, 40, 77]),
                               SamplingParams(temperature=0.0, max_tokens=30, stop=["o"]),
                               SamplingParams(temperature=0.0, max_tokens=30,
                                              stop=[" ", "a"], include_stop_str_in_output=True)]),
    "seeded-n": (dict(), [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, n=2,
                                         max_tokens=12, logprobs=3) for s in range(6)]),
    "penalties": (dict(), [SamplingParams(temperature=0.0, max_tokens=16,
                                          repetition_penalty=1.3, frequency_penalty=0.2,
                                          ignore_eos=True)] * 6),
    "chunked-prefix": (dict(max_num_batched_tokens=16, block_size=4),
                       [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 6),
    "tiny-pool": (dict(num_kv_blocks=20, block_size=4, max_model_len=64),
                  [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 6),
    "context-limit": (dict(max_model_len=48),
                      [SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)] * 6),
}
