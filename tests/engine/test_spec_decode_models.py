"""Draft networks are lossless too: a draft model, and a DeepSeek-V3 or V3.2 (sparse MLA)
checkpoint's MTP layer, through chunked prefill, a pool small enough to preempt, the prefix
cache and stop strings; greedy and seeded outputs identical to plain decoding's.

The draft model is the target itself (its greedy drafts are accepted on greedy rows: the
whole accepted path runs) or another tiny model (most drafts rejected). The MTP
layers are random, or built to draft the target's own next token (tiny_checkpoints:
accepted in runs of one repeated token).
"""

from __future__ import annotations

import pytest
from tiny_checkpoints import TINY_V32_INDEXER, build_tiny_checkpoint, build_tiny_mtp_checkpoint

from archserve import LLM, SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3 1 2 3 1 2", "A paged KV cache stores keys and values in fixed-size blocks.",
           "Once upon a time", "def main():"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "e"]),
          SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=28, n=2),
          SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=11, max_tokens=32, logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=24, min_tokens=4, ignore_eos=True)]
# float32: a verification step computes its rows in one batch, and bfloat16's rounding
# moves with a step's rows enough to flip a near-tie against plain decoding.
ENGINES = {"default": dict(max_num_seqs=4, dtype="float32"),
           "chunked-preempting": dict(max_num_seqs=6, num_kv_blocks=40, block_size=4,
                                      max_model_len=96, max_num_batched_tokens=16,
                                      dtype="float32")}


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint):
    def mtp(name: str, **kwargs) -> str:
        return build_tiny_mtp_checkpoint(str(tmp_path_factory.mktemp(name)), **kwargs)

    return {"llama": tiny_checkpoint("llama"),
            "other-llama": build_tiny_checkpoint(str(tmp_path_factory.mktemp("other")),
                                                 "llama", seed=1, tie_word_embeddings=False),
            "mtp": mtp("mtp"), "mtp-next": mtp("mtp-next", predicts_next=True),
            "mtp-v32": mtp("mtp-v32", model_type="deepseek_v32", **TINY_V32_INDEXER),
            # Its LM head the embedding: the target often repeats its newest token, which
            # a next-token MTP layer drafts right (untied, few V3.2 runs repeat one).
            "mtp-v32-next": mtp("mtp-v32-next", model_type="deepseek_v32", predicts_next=True,
                                tie_word_embeddings=True, **TINY_V32_INDEXER)}


CASES = {   # (target, speculative config, the least share of drafts accepted)
    "draft-is-target": ("llama", {"method": "draft_model", "model": "llama",
                                  "num_speculative_tokens": 4}, 0.2),
    "draft-other": ("llama", {"method": "draft_model", "model": "other-llama",
                              "num_speculative_tokens": 3}, 0.0),
    "mtp-random": ("mtp", {"method": "mtp", "num_speculative_tokens": 2}, 0.0),
    "mtp-next-token": ("mtp-next", {"method": "mtp", "num_speculative_tokens": 3}, 0.05),
    "mtp-v32-random": ("mtp-v32", {"method": "mtp", "num_speculative_tokens": 2}, 0.0),
    "mtp-v32-next-token": ("mtp-v32-next", {"method": "mtp", "num_speculative_tokens": 3}, 0.05),
}


@pytest.fixture(scope="module")
def reference(checkpoints):
    return {(target, engine): _summary(LLM(checkpoints[target], **args).generate(PROMPTS, PARAMS))
            for target in {target for target, _, _ in CASES.values()}
            for engine, args in ENGINES.items()}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_networks_are_lossless(checkpoints, reference, case, engine):
    target, spec, least = CASES[case]
    spec = {**spec, **({"model": checkpoints[spec["model"]]} if "model" in spec else {})}
    llm = LLM(checkpoints[target], speculative_config=spec, **ENGINES[engine])
    assert _summary(llm.generate(PROMPTS, PARAMS)) == reference[target, engine]
    engine_ = llm.llm_engine
    assert engine_.block_pool.num_used_blocks == 0
    stats = engine_.speculator.stats
    assert stats.num_drafts > 20
    assert stats.num_accepted_tokens >= least * stats.num_draft_tokens
    if least == 0.0:   # a random draft network: most drafts are rejected
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tmp_path, tiny_checkpoint):
    big = build_tiny_checkpoint(str(tmp_path / "big"), "llama", vocab_size=1024)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_checkpoint("llama"), speculative_config={
            "method": "draft_model", "model": big, "num_speculative_tokens": 2})


def test_mtp_on_a_checkpoint_without_mtp_layers_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LLM(tiny_checkpoint("llama"), speculative_config={"method": "mtp"})


def test_mtp_drafts_as_many_tokens_as_the_checkpoint_has_layers(checkpoints):
    llm = LLM(checkpoints["mtp"], speculative_config={"method": "mtp"})
    assert llm.llm_engine.speculator.k == 1


@pytest.mark.slow
def test_the_embedded_model_is_lossless_with_every_method_it_can_take(embedded_model_path):
    """SmolLM2-135M-Instruct (a real model nobody here wrote) copying and editing a text:
    its greedy replies with n-gram drafts, and with itself as the draft model, are the
    plain replies. (It has no MTP layers: those are the tiny DeepSeek's above.)"""
    text = ("The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and "
            "values in fixed-size blocks, so sequences of any length share one pool.")
    chats = [[{"role": "user", "content": f"Repeat this text exactly:\n{text}"}],
             [{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM(embedded_model_path, max_model_len=1024).chat(chats, params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
                 {"method": "draft_model", "model": embedded_model_path,
                  "num_speculative_tokens": 3}):
        llm = LLM(embedded_model_path, max_model_len=1024, speculative_config=spec)
        got = llm.chat(chats, params)
        assert _summary(got) == _summary(plain), spec["method"]
        stats = llm.llm_engine.speculator.stats
        assert stats.num_accepted_tokens > stats.num_draft_tokens / 3, spec["method"]
