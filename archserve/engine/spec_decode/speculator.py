"""The engine's side of speculative decoding: which rows each sequence's tokens come from,
and the drafts of the next step.

A step with drafts is resolved before the next one is scheduled, with or without
asynchronous scheduling: the next step's drafts, and its positions, follow from how many
of this step's drafts were accepted.
"""

from __future__ import annotations

from archserve.engine.scheduler import SchedulerOutput
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.spec_decode.drafter import StepSpan
from archserve.engine.spec_decode.verification import SpecDecodingStats, num_accepted
from archserve.engine.speculative_config import SpeculativeConfig


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts worth verifying for ``seq``: at most ``k``, every input inside the model's
    context (the step's last input sits at position num_tokens - 1 + drafts), and no more
    than the tokens ``max_tokens`` leaves after the one a step always yields."""
    limit = min(k, max_model_len - seq.num_tokens)
    max_tokens = seq.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - seq.num_output_tokens - 1)
    return max(0, limit)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * self.k)
        self._accepted: dict[int, int] = {}    # seq_id -> drafts accepted in the last step

    def attach(self, block_pool) -> None:  # noqa: ANN001 - the engine's KVBlockPool
        """A drafter reserves its forwards' blocks in the engine's pool."""
        if hasattr(self.proposer, "block_pool"):
            self.proposer.block_pool = block_pool

    def emitted_rows(self, out: SchedulerOutput, drawn: list[int]) -> list[list[int]]:
        """Per sampling sequence of ``out`` (in order), the rows of the sampler's output
        its new tokens come from: its one row, or the rows of its accepted drafts and the
        one after them. Counts the drafts for the stats."""
        rows: list[list[int]] = []
        row = 0
        self._accepted = {}
        for entry in out.scheduled:
            if not entry.samples:
                continue
            drafts = entry.draft_token_ids
            accepted = 0
            if drafts:
                accepted = num_accepted(drawn[row:row + len(drafts)], drafts)
                self.stats.observe(len(drafts), accepted)
                self._accepted[entry.seq.seq_id] = accepted
            rows.append(list(range(row, row + accepted + 1)))
            row += 1 + len(drafts)
        return rows

    def propose(self, out: SchedulerOutput, target_hidden=None) -> None:  # noqa: ANN001
        """Draft the next tokens of the step's running sequences that sampled (a draft
        network also reads the step's other inputs: ``target_hidden``, the target's hidden
        states of the step's rows, for MTP)."""
        spans: list[StepSpan] = []
        row = 0
        for entry in out.scheduled:
            seq = entry.seq
            first_row, row = row, row + entry.num_new_tokens
            if seq.status is not SequenceStatus.RUNNING:
                continue   # finished: its blocks are gone
            accepted = self._accepted.get(seq.seq_id, 0)
            start = seq.num_computed_tokens - entry.num_known_tokens - accepted
            limit = draft_limit(seq, self.k, self.max_model_len) if entry.samples else 0
            spans.append(StepSpan(seq, start, first_row, entry.samples, limit))
        self._accepted = {}
        if spans:
            self.proposer.propose(spans, target_hidden)
