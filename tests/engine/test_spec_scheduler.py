"""The scheduler and block pool under speculative decoding: drafts are scheduled with their
sequence's token, their KV written and, where rejected, left to be overwritten without a
block leaked or a wrong block cached; a stop inside a step's accepted tokens drops the rest.

A simulated model writes each input token into a simulated KV cache at its slot and
'samples', at every row, a pure function of the context it reads back through the block
table: a rejected draft's KV served to a later step (through a reused slot or a cached
block) changes the output, and plain decoding's outputs are the reference.
"""

from __future__ import annotations

import random

import pytest

from archserve.engine.block_pool import KVBlockPool
from archserve.engine.sampling_params import SamplingParams
from archserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.spec_decode.speculator import draft_limit
from archserve.engine.spec_decode.verification import num_accepted

VOCAB = 7          # a small vocabulary: the model's outputs repeat, drafts are often right


def next_token(context: list[int]) -> int:
    return 1 + hash(tuple(context[-3:])) % (VOCAB - 1)


class SimulatedModel:
    def __init__(self, pool: KVBlockPool) -> None:
        self.pool = pool
        self.kv = [None] * (pool.num_blocks * pool.block_size)

    def run(self, out: SchedulerOutput) -> list[list[int]]:
        """Per sampling sequence, the token drawn at each of its rows."""
        drawn = []
        for entry in out.scheduled:
            seq = entry.seq
            start = seq.num_computed_tokens
            end = start + entry.num_new_tokens
            known = seq.token_ids[start:start + entry.num_known_tokens]
            inputs = known + entry.draft_token_ids
            for token, slot in zip(inputs, self.pool.slots_for(seq, start, end), strict=True):
                self.kv[slot] = token
            if not entry.samples:
                continue
            rows = []
            for row_end in range(end - len(entry.draft_token_ids), end + 1):
                context = [self.kv[x] for x in self.pool.slots_for(seq, 0, row_end)]
                assert context == seq.token_ids[:start] + inputs[:row_end - start]
                rows.append(next_token(context))
            drawn.append(rows)
        return drawn


def run(seqs: list[Sequence], drafting: bool, rng: random.Random, num_blocks: int = 40,
        budget: int = 24, k: int = 4) -> dict[str, list[int]]:
    pool = KVBlockPool(num_blocks, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget,
                                      max_model_len=64), pool, eos_token_ids=0)
    model = SimulatedModel(pool)
    for s in seqs:
        sched.add(s)
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        drawn = model.run(out)
        sched.commit(out)
        tokens = []
        for entry, rows in zip([e for e in out.scheduled if e.samples], drawn, strict=True):
            accepted = num_accepted(rows, entry.draft_token_ids)
            tokens.append(rows[:accepted + 1])
        sched.resolve(out, tokens)
        if drafting:
            for s in sched.running:
                if s.num_uncomputed_tokens == 1:
                    s.spec_token_ids = oracle_drafts(s, k, rng)
    assert not sched.has_unfinished()
    assert pool.num_used_blocks == 0
    return {s.request_id: s.output_token_ids for s in seqs}


def oracle_drafts(seq: Sequence, k: int, rng: random.Random) -> list[int]:
    """Up to k drafts, each the model's true next token with probability 0.7."""
    context = list(seq.token_ids)
    drafts = []
    for _ in range(min(k, draft_limit(seq, k, 64))):
        token = next_token(context) if rng.random() < 0.7 else rng.randrange(1, VOCAB)
        drafts.append(token)
        context.append(token)
    return drafts


def _requests(rng: random.Random, count: int) -> list[Sequence]:
    return [Sequence(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))],
                     SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=i % 3 != 0),
                     arrival_time=i) for i in range(count)]


@pytest.mark.parametrize("seed", range(6))
def test_drafted_runs_give_plain_runs_tokens(seed):
    """Shared prompts (prefix caching), a small pool (preemption), a small budget (chunked
    prefill, truncated drafts), EOS: the outputs are plain decoding's."""
    rng = random.Random(seed)
    prompts = _requests(rng, 12)
    for s in prompts[6:]:   # half the prompts start like an earlier one
        s.prompt_token_ids[:8] = prompts[0].prompt_token_ids[:8]
        s.token_ids[:8] = s.prompt_token_ids[:8]

    def copies():
        return [Sequence(s.request_id, s.prompt_token_ids, s.sampling_params,
                         arrival_time=s.arrival_time) for s in prompts]

    plain = run(copies(), drafting=False, rng=rng)
    assert run(copies(), drafting=True, rng=rng) == plain
    assert run(copies(), drafting=True, rng=rng, num_blocks=20, budget=9) == plain


def test_a_stop_token_inside_the_accepted_drafts_ends_the_sequence_there():
    pool = KVBlockPool(16, 4)
    sched = Scheduler(SchedulerConfig(4, 32, 64), pool, eos_token_ids=0)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[9]))
    sched.add(seq)
    out = sched.schedule()
    sched.postprocess(out, [4])
    seq.spec_token_ids = [5, 9, 6]
    out = sched.schedule()
    (entry,) = out.scheduled
    assert (entry.num_new_tokens, entry.draft_token_ids) == (4, [5, 9, 6])
    sched.commit(out)
    assert seq.num_computed_tokens == 4      # the drafts are not computed before acceptance
    updated = sched.resolve(out, [[5, 9, 6, 7]])   # every draft accepted, 7 after them
    assert updated == [seq]
    assert seq.output_token_ids == [4, 5, 9] and seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == 9 and pool.num_used_blocks == 0


def test_drafts_give_way_to_the_budget_and_to_a_short_pool():
    pool = KVBlockPool(3, 4)
    sched = Scheduler(SchedulerConfig(4, 4, 12), pool)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(seq)
    sched.postprocess(sched.schedule(), [4])
    seq.spec_token_ids = [5, 6, 7, 8, 9]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [5, 6, 7]    # the budget is 4 tokens
    sched.commit(out)
    sched.resolve(out, [[5, 6, 8]])       # two accepted, then the model's own token
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 8] and seq.num_computed_tokens == 6
    seq.spec_token_ids = [1, 1, 1]
    # 7 tokens hold 2 blocks; the step would need 10 tokens = 3 blocks, the whole pool:
    # a fourth draft would not fit, and none of them would with a neighbour holding one.
    other = Sequence("o", [1], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(other)
    pool.allocate(other, 1)
    sched.waiting.remove(other)
    out = sched.schedule()
    assert [(e.seq, e.draft_token_ids) for e in out.scheduled] == [(seq, [])]
    assert out.preempted == []
