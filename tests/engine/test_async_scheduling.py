"""Asynchronous scheduling gives exactly what synchronous scheduling gives.

With ``async_scheduling`` the engine schedules step N+1 while step N's tokens are still on
their way (placeholders stand in for them). Every feature that could notice must come out
the same: greedy and seeded tokens, EOS and stop strings, max_tokens and max_model_len,
n > 1, logprobs, penalties (which fall back to waiting), chunked prefill, prefix caching,
preemption by a tiny pool (which falls back too), and aborts. Unseeded random sampling is
not compared: its batch-wide draws depend on the rows of a step, and a sequence that stopped
on a token still has a row in the step launched before that token was seen.
"""

from __future__ import annotations

import pytest
from feature_cases import CASES, PROMPTS

from archserve import LLM, SamplingParams
from archserve.engine.launched_step import LaunchedStep


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(d) for d in c.logprobs])
             for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_scheduling_matches_sync(tiny_checkpoint, case):
    engine_args, params = CASES[case]
    path = tiny_checkpoint("llama")
    results, overlapped = {}, []
    for async_scheduling in (False, True):
        # float32: an async step may carry a finished row, and bfloat16's rounding moves
        # with the rows a step holds (a near-tie may flip); the schedules must agree.
        llm = LLM(path, max_num_seqs=4, async_scheduling=async_scheduling, dtype="float32",
                  **engine_args)
        runner = llm.llm_engine.runner
        execute = runner.execute

        def counting_execute(chunks, previous=None, execute=execute):
            overlapped.append(previous is not None)
            return execute(chunks, previous)

        runner.execute = counting_execute
        results[async_scheduling] = _summary(llm.generate(PROMPTS, params))
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.llm_engine.block_pool.num_used_blocks == 0   # nothing leaked
    assert results[True] == results[False]
    # The asynchronous run really launched steps over unresolved ones (penalties never do).
    assert any(overlapped) == (case != "penalties")


def test_async_outputs_come_one_step_later_and_aborts_are_clean(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), async_scheduling=True, max_num_seqs=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    assert engine.step() == []            # the prefill is launched, nothing resolved yet
    first = engine.step()                 # resolves the prefill's tokens
    assert {o.request_id for o in first} == {"a", "b"}
    assert all(len(o.outputs[0].token_ids) == 1 for o in first)
    assert engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"b"}
    assert len(outputs[-1].outputs[0].token_ids) == 8 and outputs[-1].finished
    assert engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["execute", "wait"])
def test_a_failed_step_leaves_a_consistent_engine(tiny_checkpoint, monkeypatch,
                                                  async_scheduling, where):
    """A step that raises (say, out of memory) changes nothing a later step could trip on."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_checkpoint("llama"), async_scheduling=async_scheduling, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    for _ in range(3):
        engine.step()
    failed = False

    def fail_once(original):
        def wrapper(*args, **kwargs):
            nonlocal failed
            if not failed:
                failed = True
                raise RuntimeError("CUDA out of memory (simulated)")
            return original(*args, **kwargs)
        return wrapper

    if where == "execute":
        monkeypatch.setattr(engine.runner, "execute", fail_once(engine.runner.execute))
    else:
        monkeypatch.setattr(LaunchedStep, "wait", fail_once(LaunchedStep.wait))
    with pytest.raises(RuntimeError, match="simulated"):
        while True:
            engine.step()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert [outputs[str(i)] for i in range(3)] == expected
    assert engine.block_pool.num_used_blocks == 0


def test_a_reused_request_id_gets_its_own_prompt_logprobs(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)
    engine.add_request("x", PROMPTS[3], params)
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", PROMPTS[2], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    ids = final.prompt_token_ids
    assert len(final.prompt_logprobs) == len(ids)
    assert all(ids[i] in final.prompt_logprobs[i] for i in range(1, len(ids)))
