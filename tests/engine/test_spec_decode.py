"""Speculative decoding is lossless: the tokens, text, logprobs and finish reasons with
drafts verified are the ones plain decoding gives.

Greedy and seeded requests must come out identical (a seeded row draws its token from the
same generator key, speculation or not); unseeded sampling is checked for its
distribution instead (test_spec_decode_sampling.py). The tiny random models fall into
loops that n-gram lookup drafts well, so the drafts are accepted often, and rejected too:
each case checks that both happened.
"""

from __future__ import annotations

import pytest
from feature_cases import CASES as FEATURE_CASES
from feature_cases import PROMPTS

from archserve import LLM, SamplingParams
from archserve.engine.sequence import Sequence
from archserve.engine.spec_decode.ngram import NgramProposer
from archserve.engine.speculative_config import parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# Every engine compared with another in float32: a verification step computes its rows in
# one batch, and bfloat16's rounding moves with a step's rows enough to flip a near-tie.
FP32 = "float32"

# The engine features' cases (feature_cases.py), and one of logit bias with min_tokens.
CASES = {**FEATURE_CASES, "bias-min-tokens": (dict(), [SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, min_tokens=3, logit_bias={40: 2.0},
    presence_penalty=0.1)] * 6)}
# Each case in the synchronous engine; a few in the asynchronous one too (a step with
# drafts resolves before the next, whatever the mode).
RUNS = [(case, False) for case in sorted(CASES)] + [
    (case, True) for case in ("chunked-prefix", "seeded-n", "tiny-pool")]


def _summary(outputs):
    """(what must be identical, the log-probabilities: equal up to float rounding, since a
    verification step computes its rows in one batch)."""
    exact, floats = [], []
    for o in outputs:
        for c in o.outputs:
            exact.append((c.token_ids, c.text, c.finish_reason, c.stop_reason,
                          None if c.logprobs is None else
                          [[(t, lp.rank, lp.decoded_token) for t, lp in sorted(d.items())]
                           for d in c.logprobs]))
            floats.append([c.cumulative_logprob or 0.0] + [
                lp.logprob for d in c.logprobs or [] for _, lp in sorted(d.items())])
    return exact, floats


def _assert_same(got, expected):
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Each case's outputs without speculation."""
    path = tiny_checkpoint("llama")
    return {case: _summary(LLM(path, max_num_seqs=4, dtype=FP32, **args).generate(PROMPTS,
                                                                                 params))
            for case, (args, params) in CASES.items()}


@pytest.mark.parametrize("case, async_scheduling", RUNS)
def test_ngram_speculation_is_lossless(tiny_checkpoint, reference, case, async_scheduling):
    args, params = CASES[case]
    llm = LLM(tiny_checkpoint("llama"), max_num_seqs=4, speculative_config=NGRAM,
              async_scheduling=async_scheduling, dtype=FP32, **args)
    engine = llm.llm_engine
    _assert_same(_summary(llm.generate(PROMPTS, params)), reference[case])
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_used_blocks == 0
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if case in ("eos-and-stops", "context-limit"):   # long enough for both
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_preemption_and_chunked_prefill_with_drafts(tiny_checkpoint):
    """A pool too small for every sequence's drafts preempts (and re-prefills in chunks)
    while drafts are verified; the tokens are still plain decoding's."""
    path = tiny_checkpoint("llama")
    args = dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_batched_tokens=16,
                max_num_seqs=6)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = _summary(LLM(path, dtype=FP32, **args).generate(PROMPTS, params))
    llm = LLM(path, speculative_config=NGRAM, dtype=FP32, **args)
    preempted = []
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    scheduler.schedule = recording_schedule
    _assert_same(_summary(llm.generate(PROMPTS, params)), plain)
    assert preempted
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    assert llm.llm_engine.block_pool.num_used_blocks == 0


# ---- the config -----------------------------------------------------------------------

def test_speculative_config_parses_vllm_forms():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                 '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) \
        == ("ngram", 4, 2, 4)
    c = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3}).prompt_lookup_min == 3
    c = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 5})
    assert (c.method, c.model) == ("draft_model", "/some/draft")
    c = parse_speculative_config({"method": "deepseek_mtp"})
    assert (c.method, c.num_speculative_tokens) == ("mtp", None)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("value, complaint", [
    ("{not json", "not JSON"),
    ([1, 2], "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must be <="),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
     "disable_by_batch_size not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "mtp", "prompt_lookup_max": 2}, "belong to method ngram"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
])
def test_speculative_config_refuses_what_it_does_not_have(value, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse_speculative_config(value)


def test_a_bad_config_is_refused_before_loading(tiny_checkpoint):
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        LLM(tiny_checkpoint("llama"), speculative_config={"method": "ngram"})


# ---- n-gram lookup --------------------------------------------------------------------

def _draft(proposer: NgramProposer, tokens: list[int], limit: int = 99) -> list[int]:
    return proposer.draft(Sequence("r", tokens), limit)


def test_ngram_drafts_what_followed_the_longest_first_match():
    proposer = NgramProposer(4, 2, 3)
    # [4, 2, 3] has no earlier occurrence; [2, 3] has, at 1..2: what followed it.
    assert _draft(proposer, [1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    # The longest match wins over a shorter one that occurs earlier.
    assert _draft(proposer, [2, 3, 1, 5, 2, 3, 8, 6, 5, 2, 3]) == [8, 6, 5, 2]
    # The first occurrence of the match, not the latest.
    assert _draft(proposer, [5, 6, 1, 5, 6, 2, 5, 6]) == [1, 5, 6, 2]
    assert _draft(proposer, [1, 2, 3, 4, 5]) == []          # no n-gram repeats
    assert _draft(proposer, [1, 2, 3, 1, 2], limit=2) == [3, 1]
    assert _draft(proposer, [1, 2, 3, 1, 2], limit=0) == []


def test_ngram_index_follows_a_growing_sequence():
    """The index of a sequence grows with its tokens: the drafts equal a fresh lookup's."""
    proposer = NgramProposer(3, 1, 4)
    seq = Sequence("r", [3, 1, 4, 1, 5])
    for token in [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3]:
        assert proposer.draft(seq, 99) == _draft(proposer, list(seq.token_ids))
        seq.token_ids.append(token)


def _step_ends(llm, prompts, params) -> list[set[int]]:
    """Per prompt, the output positions that ended a step (the last token a step gave)."""
    scheduler = llm.llm_engine.scheduler
    resolve = scheduler.resolve
    ends: dict[str, set[int]] = {}

    def recording_resolve(out, new_token_ids, new_logprobs=None):
        updated = resolve(out, new_token_ids, new_logprobs)
        for seq in updated:
            ends.setdefault(seq.request_id, set()).add(seq.num_output_tokens - 1)
        return updated

    scheduler.resolve = recording_resolve
    outputs = llm.generate(prompts, params)
    scheduler.resolve = resolve
    return [ends[o.request_id] for o in outputs], outputs


def test_a_stop_string_inside_a_verified_run_drops_the_tokens_after_it(tiny_checkpoint,
                                                                        monkeypatch):
    """A stop string completed by a token in the middle of a step's accepted tokens ends
    the sequence there: the later tokens are dropped, as plain decoding never made them.
    Each stop string is the shortest tail of a speculating run's output that first
    completes at a token that was not the last of its step."""
    path = tiny_checkpoint("llama")
    spec = LLM(path, max_num_seqs=4, speculative_config=NGRAM, dtype=FP32)
    decode = spec.get_tokenizer().decode
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ends, outputs = _step_ends(spec, PROMPTS, greedy)
    params = []
    for i, (out, step_ends) in enumerate(zip(outputs, ends, strict=True)):
        ids = out.outputs[0].token_ids
        inner = [j for j in range(4, len(ids)) if j not in step_ends]
        if not inner:
            params.append(greedy)
            continue
        j = inner[len(inner) // 2]
        stop = next(text for m in range(1, j + 2)
                    if (text := decode(ids[j + 1 - m:j + 1])) and text not in decode(ids[:j]))
        params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                     stop=[stop], include_stop_str_in_output=i % 2 == 0))
    assert sum(p is not greedy for p in params) >= 3
    expected = _summary(LLM(path, max_num_seqs=4, dtype=FP32).generate(PROMPTS, params))
    dropped = []
    drop = Sequence.drop_newest_tokens
    monkeypatch.setattr(Sequence, "drop_newest_tokens",
                        lambda seq, count, lps=(): (dropped.append(count), drop(seq, count, lps)))
    got = _summary(spec.generate(PROMPTS, params))
    _assert_same(got, expected)
    assert any(dropped), "no stop string came inside a step's accepted tokens"
    # (A stop string with half a character in it never matches the streamed text.)
    assert sum(o[2] == "stop" for o in got[0]) >= 2
