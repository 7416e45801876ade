"""Scheduler: token budget, chunked prefill, decode priority, preemption, abort; stop rules."""

from __future__ import annotations

import random

import pytest

from archserve.engine.block_pool import KVBlockPool
from archserve.engine.sampling_params import SamplingParams
from archserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.stop_checker import check_stop, find_stop_string

VOCAB = 50
EOS = 0


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64,
         chunked=True, caching=True, decoding_budget=None, by_streams=()) -> Scheduler:
    pool = KVBlockPool(num_blocks, block_size, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked,
                          decoding_token_budget=decoding_budget,
                          decoding_token_budget_by_streams=by_streams)
    return Scheduler(cfg, pool, eos_token_ids=EOS)


def seq(n_prompt: int, max_tokens: int = 4, rid: str | None = None, arrival: float = 0.0,
        first: int = 1, **params) -> Sequence:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Sequence(rid or f"r{random.random()}", [first + i % 7 for i in range(n_prompt)], sp,
                    arrival_time=arrival)


class FakeModel:
    """Writes each scheduled token into a simulated KV cache at its slot and 'samples' a
    deterministic function of the context it reads back through the block table, so a
    wrong block table, a shared block overwritten or a lost token changes the output."""

    def __init__(self, sched: Scheduler) -> None:
        pool = sched.block_pool
        self.pool = pool
        self.kv = [None] * (pool.num_blocks * pool.block_size)

    def run(self, out: SchedulerOutput) -> list[int]:
        sampled = []
        for entry in out.scheduled:
            s = entry.seq
            start = s.num_computed_tokens
            end = start + entry.num_new_tokens
            for pos, slot in zip(range(start, end), self.pool.slots_for(s, start, end), strict=True):
                self.kv[slot] = s.token_ids[pos]
            if entry.samples:
                context = [self.kv[x] for x in self.pool.slots_for(s, 0, end)]
                assert context == s.token_ids
                sampled.append(1 + hash(tuple(context)) % (VOCAB - 1))
        return sampled


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_steps: int = 2000) -> list:
    for s in seqs:
        sched.add(s)
    model = FakeModel(sched)
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        decoding = any(s.num_uncomputed_tokens == 1 for s in sched.running)
        out = sched.schedule()
        cfg = sched.config
        # A step that carries decodes keeps to the smaller budget; an idle one may fill the cap.
        assert out.num_batched_tokens <= (cfg.budget_while_decoding if decoding
                                          else cfg.max_num_batched_tokens)
        assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
        assert len(out.scheduled) <= sched.config.max_num_seqs
        assert out.scheduled, "no progress"
        sched.postprocess(out, model.run(out))
        outputs.append(out)
    assert not sched.has_unfinished()
    return outputs


def test_budget_respected_and_everything_finishes_without_leaks():
    sched = make(budget=16)
    seqs = [seq(n, max_tokens=5) for n in (3, 20, 9, 30, 1, 12)]
    run_to_completion(sched, seqs)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert all(s.num_output_tokens == 5 for s in seqs)
    assert sched.block_pool.num_used_blocks == 0


def test_chunked_prefill_splits_and_continues():
    sched = make(budget=16)
    s = seq(40, max_tokens=2)
    sched.add(s)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (entry,) = out.scheduled
        chunks.append((entry.num_new_tokens, entry.samples))
        assert s.num_computed_tokens == sum(c for c, _ in chunks[:-1])
        sched.postprocess(out, [7] if entry.samples else [])
    assert chunks == [(16, False), (16, False), (8, True)]
    assert s.output_token_ids == [7]
    assert s.num_computed_tokens == 40


def test_decodes_are_scheduled_before_prefills():
    sched = make(budget=8)
    decoders = [seq(2, max_tokens=10, arrival=i) for i in range(3)]
    for d in decoders:
        sched.add(d)
    out = sched.schedule()
    sched.postprocess(out, [5] * len(out.sampling_seqs))
    late = seq(20, max_tokens=2, arrival=10)
    sched.add(late)
    out = sched.schedule()
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == (
        [(d, 1) for d in decoders] + [(late, 5)])


def test_running_chunked_prefill_yields_to_decodes():
    sched = make(budget=6)
    long = seq(30, max_tokens=2, arrival=0)
    short = seq(2, max_tokens=5, arrival=1)
    sched.add(short)
    sched.add(long)
    out = sched.schedule()                          # short prefill (2) + 4 tokens of long
    sched.postprocess(out, [3])
    out = sched.schedule()
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(short, 1), (long, 5)]


def test_without_chunking_long_prompt_waits_for_a_fresh_step():
    sched = make(budget=16, max_model_len=16, chunked=False)
    a, b = seq(10, max_tokens=3, arrival=0), seq(12, max_tokens=3, arrival=1, first=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(a, 10)]
    sched.postprocess(out, [4])
    out = sched.schedule()                          # 1 decode + 12 prompt tokens fit in 16
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(a, 1), (b, 12)]


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(budget=8, max_model_len=16, chunked=False)
    with pytest.raises(ValueError, match="KV cache holds"):
        make(num_blocks=2, block_size=4, max_model_len=16)
    sched = make(max_model_len=16)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        sched.add(seq(17))


def test_max_num_seqs_limits_the_batch():
    sched = make(max_num_seqs=2, budget=64)
    seqs = [seq(3, max_tokens=2, arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_preemption_frees_the_latest_arrival_and_it_resumes():
    # 4 blocks of 2 tokens: two sequences of 3 prompt tokens growing to 7 cannot coexist.
    sched = make(num_blocks=4, block_size=2, budget=16, max_model_len=8, caching=False)
    early, late = seq(3, max_tokens=4, arrival=0), seq(3, max_tokens=4, arrival=1, first=3)
    reference = make(num_blocks=64, block_size=2, budget=16, max_model_len=8, caching=False)
    ref_early, ref_late = seq(3, max_tokens=4, arrival=0), seq(3, max_tokens=4, arrival=1, first=3)
    run_to_completion(reference, [ref_early, ref_late])

    outs = run_to_completion(sched, [early, late])
    preempted = [s for o in outs for s in o.preempted]
    assert preempted and all(s is late for s in preempted)
    assert late.num_preemptions >= 1 and early.num_preemptions == 0
    # Recomputation gives the same tokens as an unconstrained run.
    assert early.output_token_ids == ref_early.output_token_ids
    assert late.output_token_ids == ref_late.output_token_ids
    # On re-admission the whole context (prompt + kept outputs) is prefilled again.
    step = next(i for i, o in enumerate(outs) if o.preempted)
    readmit = next(e for o in outs[step + 1:] for e in o.scheduled if e.seq is late)
    assert readmit.num_new_tokens > 1
    assert sched.block_pool.num_used_blocks == 0


def test_preempted_sequence_reuses_its_cached_prefix():
    sched = make(num_blocks=6, block_size=2, budget=32, max_model_len=12)
    a, b = seq(5, max_tokens=6, arrival=0), seq(5, max_tokens=6, arrival=1, first=4)
    run_to_completion(sched, [a, b])
    assert b.num_preemptions >= 1
    assert b.num_cached_tokens > 0                  # its computed blocks were still cached
    assert sched.block_pool.prefix_cache_hits > 0


def test_random_workloads_match_an_unconstrained_run():
    rng = random.Random(0)
    for trial in range(6):
        specs = [(rng.randint(1, 20), rng.randint(1, 8), rng.randint(1, 5)) for _ in range(8)]

        def build(specs=specs):
            return [seq(n, max_tokens=m, arrival=i, first=f, rid=f"q{i}")
                    for i, (n, m, f) in enumerate(specs)]

        big = build()
        run_to_completion(make(num_blocks=128, block_size=4, budget=64, max_model_len=32), big)
        small = build()
        sched = make(num_blocks=8, block_size=4, budget=8 + trial, max_model_len=32,
                     max_num_seqs=3)
        run_to_completion(sched, small)
        assert [s.output_token_ids for s in small] == [s.output_token_ids for s in big]
        assert sched.block_pool.num_used_blocks == 0


def test_abort_frees_blocks_at_once():
    sched = make()
    a, b = seq(9, rid="a"), seq(9, rid="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.postprocess(out, [3, 3])
    used = sched.block_pool.num_used_blocks
    assert sched.abort("a") == [a]
    assert a.status is SequenceStatus.FINISHED_ABORTED and a.block_table == []
    assert sched.block_pool.num_used_blocks < used
    assert sched.num_running == 1
    assert sched.abort("a") == [] and sched.abort("nope") == []
    waiting = seq(3, rid="w")
    sched.add(waiting)
    assert sched.abort("w") == [waiting] and sched.num_waiting == 0


def test_abort_during_a_step_is_tolerated_by_postprocess():
    sched = make()
    a, b = seq(4, rid="a"), seq(4, rid="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    updated = sched.postprocess(out, [6, 7])
    assert updated == [b] and b.output_token_ids == [7] and a.output_token_ids == []


def test_n_siblings_share_prompt_blocks_through_the_cache():
    sched = make(block_size=4, budget=64)
    params = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    first = Sequence("req", list(range(1, 11)), params, index=0, arrival_time=0)
    sched.add(first)
    sched.postprocess(out := sched.schedule(), [5] * len(out.sampling_seqs))
    second = Sequence("req", list(range(1, 11)), params, index=1, arrival_time=0)
    sched.add(second)
    sched.schedule()
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]


def test_eos_finishes_and_frees():
    sched = make()
    s = Sequence("e", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add(s)
    out = sched.schedule()
    sched.postprocess(out, [EOS])
    assert s.status is SequenceStatus.FINISHED_STOPPED and s.finish_reason == "stop"
    assert s.stop_reason is None and sched.block_pool.num_used_blocks == 0
    assert not sched.has_unfinished()


def test_finish_can_override_a_same_step_length_finish():
    sched = make()
    s = Sequence("e", [1, 2, 3], SamplingParams(max_tokens=1))
    sched.add(s)
    sched.postprocess(sched.schedule(), [9])
    assert s.finish_reason == "length"
    sched.finish(s, SequenceStatus.FINISHED_STOPPED, stop_reason="###")
    assert s.finish_reason == "stop" and s.stop_reason == "###"
    assert sched.block_pool.num_used_blocks == 0


# -- stall-free budget: a smaller budget for steps that carry decodes ------------------

def test_steps_with_decodes_keep_to_the_decoding_budget_and_idle_steps_fill_the_cap():
    sched = make(budget=32, decoding_budget=8)
    long = seq(60, max_tokens=3, arrival=0)
    sched.add(long)
    out = sched.schedule()                          # nothing decodes: the cap
    assert out.token_budget == 32 and [e.num_new_tokens for e in out.scheduled] == [32]
    sched.postprocess(out, [])
    out = sched.schedule()                          # still only a prompt in flight
    assert [e.num_new_tokens for e in out.scheduled] == [28]
    sched.postprocess(out, [4])
    late = seq(40, max_tokens=2, arrival=1, first=9)
    sched.add(late)
    out = sched.schedule()                          # long decodes: the prompt gets 8 - 1
    assert out.token_budget == 8
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(long, 1), (late, 7)]


def test_fewer_decoding_streams_take_their_larger_budget():
    """With a budget per number of decoding streams (a CPU's shared stall), one running
    stream lets a burst of prompts in at once; with more streams than the table covers the
    step keeps to the decoding budget."""
    sched = make(num_blocks=256, budget=64, decoding_budget=8, by_streams=(40, 16),
                 max_model_len=128)
    first = seq(4, max_tokens=30, arrival=0)
    sched.add(first)
    out = sched.schedule()
    sched.postprocess(out, [3])
    burst = [seq(12, max_tokens=30, arrival=1 + i, first=i + 2) for i in range(3)]
    for s in burst:
        sched.add(s)
    out = sched.schedule()                       # one decode: 40 tokens, the burst whole
    assert out.token_budget == 40
    assert [e.num_new_tokens for e in out.scheduled] == [1, 12, 12, 12]
    sched.postprocess(out, [3, 4, 5, 6])
    late = seq(30, max_tokens=3, arrival=9, first=7)
    sched.add(late)
    out = sched.schedule()                       # four decodes: past the table, 8
    assert out.token_budget == 8
    assert [e.num_new_tokens for e in out.scheduled] == [1, 1, 1, 1, 4]
    for r, budget in ((0, 64), (1, 40), (2, 16), (3, 8), (20, 8)):
        assert sched.config.budget_with_decodes(r) == budget
    with pytest.raises(ValueError, match="by_streams"):
        make(budget=64, decoding_budget=16, by_streams=(8,))     # below the decoding budget
    with pytest.raises(ValueError, match="by_streams"):
        make(budget=64, decoding_budget=16, by_streams=(65,))    # above the cap


def test_decodes_are_never_starved_and_a_long_prompt_finishes_in_chunks():
    """Under a stream of long prompts, every running decode gets its token in every step,
    and each prompt advances by what the decodes leave of the budget."""
    sched = make(num_blocks=256, budget=64, decoding_budget=12, max_model_len=128)
    model = FakeModel(sched)
    decoders = [seq(3, max_tokens=40, arrival=i, first=i + 1) for i in range(4)]
    prompts = [seq(90, max_tokens=3, arrival=10 + i, first=i + 2) for i in range(3)]
    for s in decoders:
        sched.add(s)
    sched.postprocess(first := sched.schedule(), model.run(first))   # prefill the decoders
    for s in prompts:
        sched.add(s)
    chunks: dict[int, list[int]] = {s.seq_id: [] for s in prompts}
    for _ in range(200):
        if not sched.has_unfinished():
            break
        decoding = [s for s in sched.running if s.num_uncomputed_tokens == 1]
        out = sched.schedule()
        got = {e.seq.seq_id: e.num_new_tokens for e in out.scheduled}
        assert all(got.get(s.seq_id) == 1 for s in decoding), "a running decode was skipped"
        if decoding:
            assert out.num_batched_tokens <= 12
        for e in out.scheduled:
            if e.seq.seq_id in chunks and e.num_new_tokens > 1:
                chunks[e.seq.seq_id].append(e.num_new_tokens)
        sched.postprocess(out, model.run(out))
    assert not sched.has_unfinished()
    for s in prompts:
        assert sum(chunks[s.seq_id]) == 90 and len(chunks[s.seq_id]) > 1   # chunked, complete
        assert s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == 3
    assert all(s.num_output_tokens == 40 for s in decoders)
    assert sched.block_pool.num_used_blocks == 0


def test_decoding_budget_gives_the_same_tokens_as_one_budget_with_preemption():
    # A pool too small for everything at once: preemption by recomputation still works
    # when steps with decodes have the smaller budget.
    specs = [(13, 6, 1), (3, 7, 2), (17, 4, 3), (5, 8, 4)]   # (prompt, max_tokens, first)

    def build():
        return [seq(n, max_tokens=m, arrival=i, first=f, rid=f"p{i}")
                for i, (n, m, f) in enumerate(specs)]

    reference = build()
    run_to_completion(make(num_blocks=128, block_size=2, budget=64, max_model_len=24),
                      reference)
    tight = build()
    sched = make(num_blocks=12, block_size=2, budget=16, decoding_budget=5, max_model_len=24,
                 caching=False)
    outs = run_to_completion(sched, tight)
    assert any(o.preempted for o in outs)
    assert [s.output_token_ids for s in tight] == [s.output_token_ids for s in reference]
    assert sched.block_pool.num_used_blocks == 0


def test_decoding_budget_validation():
    with pytest.raises(ValueError, match="decoding_token_budget"):
        make(budget=16, decoding_budget=17)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        make(budget=64, max_model_len=64, chunked=False, decoding_budget=16)
    assert make(budget=16).config.budget_while_decoding == 16


# -- token-level stop rules ------------------------------------------------------------

def stepped(params: SamplingParams, outputs: list[int], prompt_len: int = 3) -> Sequence:
    s = Sequence("s", list(range(1, prompt_len + 1)), params)
    for t in outputs:
        s.append_token(t)
    return s


def test_check_stop_rules():
    eos = {0}
    assert check_stop(stepped(SamplingParams(), [5, 0]), eos, 100)
    assert not check_stop(stepped(SamplingParams(ignore_eos=True), [5, 0]), eos, 100)
    assert not check_stop(stepped(SamplingParams(min_tokens=3), [5, 0]), eos, 100)
    s = stepped(SamplingParams(stop_token_ids=[7]), [7])
    assert check_stop(s, eos, 100) and s.stop_reason == 7 and s.finish_reason == "stop"
    s = stepped(SamplingParams(max_tokens=2), [5, 6])
    assert check_stop(s, eos, 100) and s.finish_reason == "length"
    assert not check_stop(stepped(SamplingParams(max_tokens=3), [5, 6]), eos, 100)
    s = stepped(SamplingParams(max_tokens=None), [5, 6], prompt_len=8)
    assert check_stop(s, eos, 10) and s.finish_reason == "length"
    s = stepped(SamplingParams(max_tokens=2), [5, 0])  # EOS on the last allowed token
    assert check_stop(s, eos, 100) and s.finish_reason == "stop"


def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["wor"]) == (6, "wor")
    assert find_stop_string("hello world", 2, ["hello"]) is None   # old text, checked before
    assert find_stop_string("abcXY", 1, ["cXY"]) == (2, "cXY")      # straddles old and new
    assert find_stop_string("a.b!c", 5, ["!", "."]) == (1, ".")      # earliest wins
    assert find_stop_string("abc", 3, []) is None
    assert find_stop_string("abc", 0, ["c"]) is None


def test_a_gated_sequence_keeps_its_place_while_later_ones_are_admitted():
    """A sequence whose gate is open (its grammar compiling) is passed over, not dropped:
    it stays at the front and is admitted once the gate closes."""
    from concurrent.futures import Future
    s = make()
    gated, free = seq(6, arrival=0.0), seq(6, arrival=1.0)
    gated.gate = Future()
    s.add(gated)
    s.add(free)
    out = s.schedule()
    assert [e.seq for e in out.scheduled] == [free] and list(s.waiting) == [gated]
    s.postprocess(out, [3])
    gated.gate.set_result(None)
    out = s.schedule()
    assert gated in [e.seq for e in out.scheduled] and not s.waiting


def test_waiting_fill_a_step_by_sequences_or_prompt_tokens():
    """What ends a server's burst window early: a step of an idle engine is full."""
    sched = make(max_num_seqs=3, budget=32)
    assert not sched.waiting_fill_a_step()
    sched.add(seq(10))
    sched.add(seq(10))
    assert not sched.waiting_fill_a_step()          # 2 of 3 sequences, 20 of 32 tokens
    sched.add(seq(10))
    assert sched.waiting_fill_a_step()              # max_num_seqs
    tokens = make(max_num_seqs=8, budget=32)
    tokens.add(seq(20))
    assert not tokens.waiting_fill_a_step()
    tokens.add(seq(12))
    assert tokens.waiting_fill_a_step()             # 32 prompt tokens: the step's budget
