"""Speculative decoding: proposers draft tokens, one target forward verifies them.

- ``config``: vLLM's ``speculative_config`` (ngram, draft_model, mtp);
- ``ngram``: prompt lookup; ``draft_model`` / ``mtp``: a model drafts greedily;
- ``verification``: the sampler's rows of a sequence with drafts, the acceptance rule
  (speculative sampling for a deterministic proposal: lossless), the spec_decode stats;
- ``speculator``: what the engine calls after each step: accept, then propose.
"""
