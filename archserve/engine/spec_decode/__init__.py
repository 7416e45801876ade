"""Speculative decoding: proposers draft tokens, one target forward verifies them.

- ``config``: vLLM's ``speculative_config`` (ngram, draft_model, mtp);
- ``ngram``: prompt lookup; ``drafter``: a draft network drafts greedily, in a runner of
  its own whose cache shares the target's blocks (``mtp``: how MTP layers read a step);
- ``verification``: the sampler's rows of a sequence with drafts, the acceptance rule
  (speculative sampling for a deterministic proposal: lossless), the spec_decode stats;
- ``speculator``: what the engine calls after each step: accept, then propose;
- ``setup``: the start-up plan (explain and doctor read it), the draft network's loading,
  runner and graphs.
"""
