"""RequestOutputKind: cumulative, delta and final-only outputs tell the same story."""

from __future__ import annotations

from dataclasses import replace

import pytest

from archserve import LLM, SamplingParams
from archserve.engine.sampling_params import RequestOutputKind

PROMPTS = ["Ünïcödé façade", "Hello world! How are you", "東京 ☃ 😀"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama")).llm_engine


def run(engine, params):
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[rid] for rid in ids]


@pytest.mark.parametrize("stop", [None, ["zz"]], ids=["no-stop", "stop-strings"])
def test_kinds_agree(engine, stop):
    base = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=stop,
                          logprobs=1)
    cumulative = run(engine, base)
    delta = run(engine, replace(base, output_kind=RequestOutputKind.DELTA))
    final = run(engine, replace(base, output_kind=RequestOutputKind.FINAL_ONLY))
    for c, d, f in zip(cumulative, delta, final, strict=True):
        last = c[-1].outputs[0]
        assert len(f) == 1 and f[0].finished
        assert f[0].outputs[0].text == last.text
        assert f[0].outputs[0].token_ids == last.token_ids
        assert "".join(o.outputs[0].text for o in d) == last.text
        assert sum((o.outputs[0].token_ids for o in d), []) == last.token_ids
        assert len(sum((o.outputs[0].logprobs for o in d), [])) == len(last.token_ids)
        assert len(c) == len(d) > 1


def test_generate_does_not_change_the_callers_params(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=3)
    llm.generate(["Hello"], params)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_streamed_text_never_shows_what_a_stop_string_takes_back(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = run(engine, greedy)[1][-1].outputs[0].text
    stop = full[6:10]
    outputs = run(engine, replace(greedy, stop=[stop]))[1]
    final = outputs[-1].outputs[0].text
    assert final == full[:full.find(stop)]
    for out in outputs:
        assert final.startswith(out.outputs[0].text)


def test_request_counts_are_requests_not_sequences(engine):
    engine.add_request(None, "Hello", SamplingParams(n=4, max_tokens=5))
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] + stats["num_waiting"] == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_truncate_prompt_tokens_keeps_the_tail(engine):
    from archserve.engine.sampling_params import SamplingParams as SP
    ids = list(range(10, 40))
    rid = engine.add_request(None, ids, SP(max_tokens=1, truncate_prompt_tokens=8))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].prompt_token_ids == ids[-8:]
