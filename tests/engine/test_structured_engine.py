"""Structured output in the engine: the grammar holds, free rows are untouched, the
mask agrees with a plain reference, async scheduling gives what sync gives."""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.structured import GrammarError
from archserve.structured import StructuredOutputsParams as S
from archserve.structured.bitmask import apply_bitmask

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
FREE_PROMPTS = ["The capital of France is", "1 2 3 4", "def main():"]


@pytest.fixture(scope="module")
def llm(embedded_model_path):
    # float32: the comparisons below are token for token between engines of other batch
    # shapes (speculating, async), which bfloat16 (auto on a CPU with native bf16) is not
    return LLM(embedded_model_path, max_model_len=512, dtype="float32")


def _constrained():
    return [("Describe a person as JSON:", S(json=PERSON)),
            ("Is water wet? Answer:", S(choice=["yes", "no", "it depends"])),
            ("A date in ISO format:", S(regex=r"\d{4}-\d{2}-\d{2}")),
            ("A JSON object about cats:", S(json_object=True, disable_any_whitespace=True))]


def _check(spec: S, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text)
    else:
        assert isinstance(json.loads(text), dict)


def test_constrained_outputs_match_and_free_rows_are_untouched(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(FREE_PROMPTS, free)
    cases = _constrained()
    prompts = [p for p, _ in cases] + FREE_PROMPTS
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
              for _, spec in cases] + [free] * len(FREE_PROMPTS)
    mixed = llm.generate(prompts, params)
    for (_, spec), out in zip(cases, mixed, strict=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (spec, c.text)
        _check(spec, c.text)
    for a, b in zip(alone, mixed[len(cases):], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_sampled_constrained_outputs_match(llm):
    cases = _constrained()
    outs = llm.generate([p for p, _ in cases],
                        [SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=32,
                                        structured_outputs=s) for _, s in cases])
    for (_, spec), out in zip(cases, outs, strict=True):
        for c in out.outputs:
            if c.finish_reason == "stop":
                _check(spec, c.text)


def test_async_scheduling_gives_what_sync_gives(llm):
    """The grammar reads the in-flight step's tokens when steps overlap: same tokens."""
    engine = llm.llm_engine
    cases = _constrained()[:2]
    prompts = [p for p, _ in cases] + FREE_PROMPTS[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=s)
              for _, s in cases] + [SamplingParams(temperature=0.0, max_tokens=12)] * 2
    sync_config = engine.config
    results = []
    try:
        for async_scheduling in (False, True):
            engine.config = dataclasses.replace(sync_config, async_scheduling=async_scheduling)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    finally:
        engine.config = sync_config
    assert results[0] == results[1]


def test_speculative_decoding_keeps_to_the_grammar(llm, embedded_model_path):
    """Drafts verified on constrained rows: each row's mask is the grammar's after the
    drafts before it (a fork of the sequence's matcher), so greedy and seeded outputs are
    the plain engine's, and drafts the grammar refuses are simply rejected."""
    text = '{"name": "Ada", "age": 36}'
    cases = [*_constrained(),
             (f"Copy this JSON exactly: {text}\nCopy:", S(json=PERSON)),
             (f"Copy: {text} {text}", S(json_object=True))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
              for _, spec in cases]
    params += [SamplingParams(temperature=0.8, seed=3, max_tokens=32, structured_outputs=spec)
               for _, spec in cases[-2:]]
    prompts = [p for p, _ in cases] + [p for p, _ in cases[-2:]]
    plain = llm.generate(prompts, params)
    spec_llm = LLM(embedded_model_path, max_model_len=512, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    got = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    for (_, spec), out in zip(cases, got, strict=False):
        if out.outputs[0].finish_reason == "stop":
            _check(spec, out.outputs[0].text)
    stats = spec_llm.llm_engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_a_compiling_grammar_waits_while_others_run(llm, monkeypatch):
    """A request whose grammar is not compiled yet is not scheduled; the free request
    beside it runs to the end; once the grammar arrives the first one runs and matches."""
    engine = llm.llm_engine
    compiler = engine.grammars
    spec = S(choice=["alpha", "beta"])
    compiled = compiler.compile(spec)
    pending: Future = Future()
    monkeypatch.setattr(compiler, "submit", lambda _spec: pending)
    waiting = engine.prepare_request(
        "gated", "Pick one:", SamplingParams(temperature=0.0, max_tokens=8,
                                             structured_outputs=spec))
    engine.queue_request(waiting)
    engine.add_request("free", "1 2 3", SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert waiting.seqs[0].num_computed_tokens == 0 and not waiting.seqs[0].is_finished
    pending.set_result(compiled)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["gated"].outputs[0].text in ("alpha", "beta")


def test_a_grammar_failing_after_queueing_ends_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine
    pending: Future = Future()
    monkeypatch.setattr(engine.grammars, "submit", lambda _spec: pending)
    engine.queue_request(engine.prepare_request(
        "doomed", "hi", SamplingParams(max_tokens=4, structured_outputs=S(regex="a+"))))
    engine.add_request("fine", "hello", SamplingParams(temperature=0.0, max_tokens=3))
    pending.set_exception(GrammarError("structured output regex does not compile: boom"))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    doomed = finished["doomed"].outputs[0]
    assert doomed.finish_reason == "abort" and "boom" in doomed.stop_reason
    assert len(finished["fine"].outputs[0].token_ids) == 3


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "objekt"}), "objekt"),
    (dict(regex="[a-"), "regex"),
    (dict(grammar="root ::= "), "grammar"),
])
def test_a_bad_spec_is_refused_before_it_is_queued(llm, spec, words):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=words):
        engine.add_request(None, "hi", SamplingParams(structured_outputs=S(**spec)))
    assert not engine.has_unfinished_requests()


def test_the_spec_shape_is_checked():
    with pytest.raises(ValueError, match="exactly one"):
        S(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="choice"):
        S(choice=[])
    assert S(json={"a": 1, "b": 2}).cache_key() == S(json='{"b": 2, "a": 1}').cache_key()


@pytest.mark.parametrize("rows", [[1, 4], [0, 1, 2, 3, 4, 5]])
def test_apply_bitmask_matches_a_reference(rows):
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 6, 100
    logits = torch.randn(batch, vocab, generator=gen)
    rows = torch.tensor(rows)
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    words = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int64)
    for r in range(len(rows)):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)   # as signed words
    out = apply_bitmask(logits.clone(), bitmask, rows)
    expected = logits.clone()
    for r, row in enumerate(rows.tolist()):
        expected[row][~allowed[r]] = float("-inf")
    assert torch.equal(out, expected)


def _mixed_batch_on(path: str, **engine_args) -> None:
    """Ten constrained rows (the batch fill) beside free rows: the grammar holds, the free
    rows' greedy tokens are those they get alone."""
    llm = LLM(path, max_model_len=256, **engine_args)
    specs = [S(choice=["yes", "no", "maybe"]), S(regex=r"\d{4}-\d{2}-\d{2}"),
             S(json={"type": "object", "additionalProperties": False, "required": ["k", "n"],
                     "properties": {"k": {"enum": ["a", "b"]},
                                    "n": {"type": "integer", "minimum": 0, "maximum": 99}}},
               disable_any_whitespace=True)] * 4
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(FREE_PROMPTS, free)
    outs = llm.generate([f"Answer {i}:" for i in range(len(specs))] + FREE_PROMPTS,
                        [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=s)
                         for s in specs] + [free] * len(FREE_PROMPTS))
    for spec, out in zip(specs, outs, strict=False):
        assert out.outputs[0].finish_reason == "stop", (spec, out.outputs[0].text)
        _check(spec, out.outputs[0].text)
    for a, b in zip(alone, outs[len(specs):], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.gpu
def test_constrained_decoding_on_the_gpu_with_graphs_and_async_scheduling(tiny_checkpoint):
    """A random tiny model (the GPU machine has no embedded model): CUDA graphs and async
    scheduling are the CUDA defaults; the mask is applied after the graph, in the sampler.

    float32, not the GPU's default bf16: the free rows must give alone what they give beside
    the constrained ones, a batch of other sizes (other GEMM and attention kernels), and in
    bf16 their greedy continuations hold exact ties (top-2 log-probs 0.0 apart at 3 of 48
    steps, measured on the CPU), where a last-bit difference picks the other token; in
    float32 the closest two are 0.004 apart."""
    _mixed_batch_on(tiny_checkpoint("llama-h64"), dtype="float32",
                    kv_cache_memory_bytes=1 << 28)


def test_batch_fill_and_async_scheduling_on_a_tiny_model(tiny_checkpoint):
    """The same on the CPU: twelve constrained rows take xgrammar's batch fill, and the
    steps overlap (the grammar reads the in-flight step's tokens)."""
    _mixed_batch_on(tiny_checkpoint("llama-h64"), async_scheduling=True)


def test_a_grammar_that_fails_in_a_step_ends_only_its_row(llm):
    """A matcher raising while the mask is filled does not fail the step: its row may
    only stop, the row beside it keeps its grammar."""
    from archserve.structured.bitmask import GrammarState, fill_bitmask

    class Broken:
        def is_terminated(self):
            return False

        def fill_next_token_bitmask(self, *args):
            raise RuntimeError("boom")

    engine = llm.llm_engine
    compiled = engine.grammars.submit(S(regex="a+"))
    states = [GrammarState(compiled), GrammarState(compiled)]
    states[1]._matcher = Broken()
    vocab = engine.model_config.vocab_size
    eos = sorted(engine.eos_token_ids)
    mask = fill_bitmask(states, vocab, eos)
    logits = apply_bitmask(torch.zeros(2, vocab), mask, torch.tensor([0, 1]))
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert allowed[1] == set(eos) and states[1].failed
    a = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    assert a in allowed[0] and not states[0].failed


def test_the_engine_and_server_import_without_xgrammar():
    """xgrammar loads with the first constrained request, not with the engine: hidden
    here, the engine and the server still import."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['xgrammar'] = None; "
            "import archserve.engine.llm_engine, archserve.serve.app, archserve.structured")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
