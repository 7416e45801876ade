"""Scheduler: continuous batching under a per-step token budget, with preemption.

Every sequence is "tokens not yet in the KV cache"; a step gives each chosen sequence
``num_new_tokens`` of them, so prefill, chunked prefill and decode are one case. Order
of a step:

1. running sequences that decode (one token each), oldest arrival first: they always get
   their token before any prompt does;
2. running sequences part-way through a chunked prefill;
3. waiting sequences (new, or preempted and re-prefilling), front of the queue first,
   while ``max_num_seqs`` and the budget allow; none are admitted in a step that had to
   preempt, because that step is already short of blocks. A sequence whose ``gate`` is
   still open (its grammar compiling) is passed over, keeping its place; so is one whose
   LoRA adapter would be one more than ``max_loras`` distinct adapters among the running
   sequences (each layer has that many adapter slots).

When the pool runs dry for a running sequence, the most recently arrived running
sequence is preempted by recomputation: its blocks are freed, ``num_computed_tokens``
goes back to 0 and it returns to the front of the queue, keeping its generated tokens,
which it re-prefills on re-admission (the prefix cache often makes that cheap).

A step's token budget depends on whether it carries decodes (stall-free batching, as in
Sarathi-Serve): with decodes running it is ``decoding_token_budget`` (on a CPU larger
while few sequences decode: ``decoding_token_budget_by_streams``), so a prefill chunk
rides along without stretching the step that every streaming request waits for; with none
running (an idle engine, or only prompts in flight) nobody waits on the step's length, so
prompts may fill ``max_num_batched_tokens`` and reach their first token sooner.

The engine drives one step as ``schedule()`` -> run the model -> ``postprocess()``.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from archserve.engine.block_pool import KVBlockPool
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.stop_checker import check_stop, reached_length_limit


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Tokens of a step that carries running decodes; None: max_num_batched_tokens (every
    # step alike, vLLM's meaning of the flag). engine/step_budget.py chooses it.
    decoding_token_budget: int | None = None
    # Distinct LoRA adapters the running sequences may use at once; None: no adapters.
    max_loras: int | None = None
    # A step with R decodes, R <= len: entry R - 1 (fewer streams share a longer stall,
    # engine/step_budget.py); more decodes, or (): decoding_token_budget.
    decoding_token_budget_by_streams: tuple[int, ...] = ()

    @property
    def budget_while_decoding(self) -> int:
        return self.decoding_token_budget or self.max_num_batched_tokens

    def budget_with_decodes(self, num_decodes: int) -> int:
        """The token budget of a step that carries ``num_decodes`` running decodes."""
        if num_decodes == 0:
            return self.max_num_batched_tokens
        by_streams = self.decoding_token_budget_by_streams
        if num_decodes <= len(by_streams):
            return by_streams[num_decodes - 1]
        return self.budget_while_decoding

    def validate(self, block_pool: KVBlockPool) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if not 1 <= self.budget_while_decoding <= self.max_num_batched_tokens:
            raise ValueError(f"decoding_token_budget ({self.decoding_token_budget}) must be in "
                             f"[1, max_num_batched_tokens={self.max_num_batched_tokens}]")
        if not all(self.budget_while_decoding <= b <= self.max_num_batched_tokens
                   for b in self.decoding_token_budget_by_streams):
            raise ValueError(f"decoding_token_budget_by_streams "
                             f"({self.decoding_token_budget_by_streams}) must be in "
                             f"[{self.budget_while_decoding}, {self.max_num_batched_tokens}]")
        if not self.enable_chunked_prefill and self.decoding_token_budget not in (
                None, self.max_num_batched_tokens):
            # A prompt is prefilled whole: behind a smaller budget it would wait for a step
            # without decodes, which a busy server may never have.
            raise ValueError("decoding_token_budget needs chunked prefill")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        capacity = block_pool.num_blocks * block_pool.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({block_pool.num_blocks} blocks of "
                f"{block_pool.block_size}), fewer than max_model_len ({self.max_model_len}); "
                f"give it more memory or lower max_model_len")


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``seq``, starting at its ``num_computed_tokens``."""

    seq: Sequence
    num_new_tokens: int
    samples: bool  # the chunk reaches the sequence's newest token: its logits are sampled
    # Speculative decoding: drafts that follow the newest token, the last inputs of the
    # chunk (counted in num_new_tokens); every one of the chunk's rows is sampled.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        """Inputs that are the sequence's own tokens: computed once the step runs (drafts
        only once they are accepted)."""
        return self.num_new_tokens - len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes, then prefills
    preempted: list[Sequence] = field(default_factory=list)
    # Window rings (engine/window_rings.py) the runner copies before the step's forward:
    # (source ring, target ring), in order.
    ring_copies: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    token_budget: int = 0          # what this step could take (it carried decodes, or not)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """Sequences whose next token this step samples, in ``scheduled`` order."""
        return [s.seq for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: KVBlockPool,
                 eos_token_ids: int | Collection[int] | None = None) -> None:
        config.validate(block_pool)
        self.config = config
        self.block_pool = block_pool
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []           # sorted by arrival: preempt from the end
        self._by_request: dict[str, list[Sequence]] = {}

    # -- queue --------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_fill_a_step(self) -> bool:
        """Whether the waiting sequences already fill the next step of an idle engine (as
        many sequences as may run, or as many prompt tokens as a step without decodes
        takes): a request arriving now could not join that step anyway."""
        config = self.config
        return (len(self.waiting) + len(self.running) >= config.max_num_seqs
                or sum(s.num_uncomputed_tokens for s in self.waiting)
                >= config.max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens is longer than "
                             f"max_model_len ({self.config.max_model_len})")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_request.setdefault(seq.request_id, []).append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of ``request_id`` now; returns them."""
        seqs = [s for s in self._by_request.get(request_id, ()) if not s.is_finished]
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def finish(self, seq: Sequence, status: SequenceStatus,
               stop_reason: int | str | None = None) -> None:
        """Mark ``seq`` finished and free its blocks.

        On an already finished sequence this only updates status and stop reason, so a
        stop string found after detokenizing can override a same-step "length".
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        was_finished = seq.is_finished
        seq.status = status
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        if was_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_pool.free(seq)
        self._forget(seq)

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        planned: dict[int, ScheduledSeq] = {}  # seq_id -> its entry, so preemption can undo it

        # A sequence whose pending token already reaches its length limit finishes when that
        # token is resolved (asynchronous scheduling): nothing more to compute for it.
        limit = self.config.max_model_len
        active = [s for s in self.running
                  if not (s.num_pending and reached_length_limit(s, limit))]
        decodes = [s for s in active if s.num_uncomputed_tokens == 1]
        prefills = [s for s in active if s.num_uncomputed_tokens > 1]
        budget = out.token_budget = self.config.budget_with_decodes(len(decodes))
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if budget == 0:
                break
            num_new = self.block_pool.chunk_limit(seq, seq.num_computed_tokens,
                                                  min(seq.num_uncomputed_tokens, budget))
            drafts = seq.spec_token_ids[:budget - 1] if num_new == 1 else []
            if drafts and self.block_pool.append_slots(seq, 1 + len(drafts)):
                planned[seq.seq_id] = ScheduledSeq(seq, 1 + len(drafts), True, drafts)
                budget -= 1 + len(drafts)
                continue
            # Drafts are optional: without room for them the sequence decodes one token.
            while not self.block_pool.append_slots(seq, num_new):
                victim = self.running[-1]
                budget += self._preempt(victim, planned, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                planned[seq.seq_id] = ScheduledSeq(seq, num_new, num_new == seq.num_uncomputed_tokens)
                budget -= num_new

        if not out.preempted:
            budget = self._admit_waiting(budget, planned)

        out.scheduled = list(planned.values())
        out.num_batched_tokens = out.token_budget - budget
        if self.block_pool.rings is not None and out.scheduled:   # else the next step's
            out.ring_copies = self.block_pool.rings.drain_copies()
        return out

    def postprocess(self, output: SchedulerOutput, sampled_token_ids: Iterable[int],
                    sampled_logprobs: Iterable[float] | None = None) -> list[Sequence]:
        """Record a finished forward pass of one token per sampling sequence: ``commit``
        then ``resolve`` with its tokens."""
        self.commit(output)
        return self.resolve(output, [[t] for t in sampled_token_ids],
                            None if sampled_logprobs is None else [[lp] for lp in sampled_logprobs])

    def commit(self, output: SchedulerOutput) -> None:
        """The forward pass of ``output`` is under way: its tokens count as computed (a
        chunk's drafts not yet), and every sampling sequence holds a placeholder for its
        new token until ``resolve``.

        The next ``schedule`` may then run before the tokens reach the host.
        """
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted, or finished by the resolve of the step before
            seq.num_computed_tokens += entry.num_known_tokens   # drafts: once accepted
            self.block_pool.cache_full_blocks(seq)   # every computed token has its value
            if entry.samples:
                seq.append_placeholder()

    def uncommit(self, output: SchedulerOutput) -> None:
        """Undo ``commit`` for a step whose tokens will never arrive (the device failed):
        its sequences compute those tokens again next time, and the blocks (and window
        ring snapshots) that commit gave the prefix cache leave it."""
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if entry.samples and seq.num_pending:
                seq.drop_newest_placeholder()
            seq.num_computed_tokens -= entry.num_known_tokens
            self.block_pool.uncache_uncomputed(seq)

    def resolve(self, output: SchedulerOutput, new_token_ids: Iterable[SequenceOf[int]],
                new_logprobs: Iterable[SequenceOf[float]] | None = None) -> list[Sequence]:
        """Give the committed step's sampling sequences their new tokens, and stop.

        ``new_token_ids`` (and ``new_logprobs``) hold one list per sequence of
        ``output.sampling_seqs``: its sampled token, or with drafts, the accepted drafts and
        the token after them (their inputs count as computed now). The tokens are taken
        one at a time, as separate steps would: after the one that stops the sequence,
        the rest are dropped. Returns the sequences that received tokens, in that order;
        finished ones have a finished status and no blocks.
        """
        tokens = iter(new_token_ids)
        logprobs = iter(new_logprobs) if new_logprobs is not None else None
        updated: list[Sequence] = []
        finished = False
        for entry in output.scheduled:
            if not entry.samples:
                continue
            seq = entry.seq
            new = next(tokens)
            lps = next(logprobs) if logprobs is not None else None
            if seq.status is not SequenceStatus.RUNNING or not seq.num_pending:
                continue  # aborted or finished while the step ran
            updated.append(seq)
            for i, token in enumerate(new):
                logprob = None if lps is None else float(lps[i])
                if i == 0:
                    seq.resolve_placeholder(int(token), logprob)
                else:   # the input before it was an accepted draft: computed now
                    seq.num_computed_tokens += 1
                    seq.append_token(int(token), logprob)
                if check_stop(seq, self.eos_token_ids, self.config.max_model_len):
                    break
            if len(new) > 1 and not seq.is_finished:
                self.block_pool.cache_full_blocks(seq)
            if seq.is_finished:
                self.block_pool.free(seq)
                self._forget(seq)
                finished = True
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return updated

    # -- internals ----------------------------------------------------------------
    def _admit_waiting(self, budget: int, planned: dict[int, ScheduledSeq]) -> int:
        """Admit waiting sequences, front first; one whose gate is still open (its grammar
        compiling) keeps its place while those behind it go ahead."""
        chunked = self.config.enable_chunked_prefill
        skipped: list[Sequence] = []
        adapters = {s.lora.cache_key for s in self.running if s.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.is_ready or self._adapter_over_limit(seq, adapters):
                skipped.append(self.waiting.popleft())
                continue
            prefix = self.block_pool.find_cached_prefix(seq)
            remaining = seq.num_tokens - prefix.num_tokens
            if remaining > budget and not chunked:
                # Validation guarantees a whole prompt fits an empty step, so it waits for one.
                break
            num_new = self.block_pool.chunk_limit(seq, prefix.num_tokens, min(remaining, budget))
            if not self.block_pool.allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            if seq.lora is not None:
                adapters.add(seq.lora.cache_key)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival_key)
            planned[seq.seq_id] = ScheduledSeq(seq, num_new, num_new == remaining)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _adapter_over_limit(self, seq: Sequence, adapters: set[bytes]) -> bool:
        """Whether running ``seq`` would take one more adapter than the slots hold."""
        return (seq.lora is not None and seq.lora.cache_key not in adapters
                and len(adapters) >= (self.config.max_loras or 0))

    def _preempt(self, seq: Sequence, planned: dict[int, ScheduledSeq],
                 out: SchedulerOutput) -> int:
        """Preempt ``seq`` by recomputation; returns the budget its dropped entry held."""
        self.running.remove(seq)
        self.block_pool.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        entry = planned.pop(seq.seq_id, None)
        return entry.num_new_tokens if entry is not None else 0

    def _forget(self, seq: Sequence) -> None:
        siblings = self._by_request.get(seq.request_id)
        if siblings is None:
            return
        if seq in siblings:
            siblings.remove(seq)
        if not siblings:
            del self._by_request[seq.request_id]
