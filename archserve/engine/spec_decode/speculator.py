"""The engine's side of speculative decoding: which rows each sequence's tokens come from,
and the drafts of the next step.

A step with drafts is resolved before the next one is scheduled, with or without
asynchronous scheduling: the next step's drafts, and its positions, follow from how many
of this step's drafts were accepted.
"""

from __future__ import annotations

from archserve.engine.scheduler import SchedulerOutput
from archserve.engine.sequence import Sequence
from archserve.engine.spec_decode.config import SpeculativeConfig
from archserve.engine.spec_decode.verification import SpecDecodingStats, num_accepted


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts worth verifying for ``seq``: at most ``k``, every input inside the model's
    context (the step's last input sits at position num_tokens - 1 + drafts), and no more
    than the tokens ``max_tokens`` leaves after the one a step always yields."""
    limit = min(k, max_model_len - seq.num_tokens)
    max_tokens = seq.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - seq.num_output_tokens - 1)
    return max(0, limit)


def speculates(seq: Sequence) -> bool:
    """Whether ``seq``'s requests take drafts. A grammar's rows are not verified against
    drafts (each row would need the matcher advanced over the drafts before it)."""
    return seq.sampling_params.structured_outputs is None


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * self.k)

    def emitted_rows(self, out: SchedulerOutput, drawn: list[int]) -> list[list[int]]:
        """Per sampling sequence of ``out`` (in order), the rows of the sampler's output
        its new tokens come from: its one row, or the rows of its accepted drafts and the
        one after them. Counts the drafts for the stats."""
        rows: list[list[int]] = []
        row = 0
        for entry in out.scheduled:
            if not entry.samples:
                continue
            drafts = entry.draft_token_ids
            accepted = 0
            if drafts:
                accepted = num_accepted(drawn[row:row + len(drafts)], drafts)
                self.stats.observe(len(drafts), accepted)
            rows.append(list(range(row, row + accepted + 1)))
            row += 1 + len(drafts)
        return rows

    def propose(self, out: SchedulerOutput) -> None:
        """Draft the next tokens of the step's running sequences that sampled."""
        for entry in out.scheduled:
            seq = entry.seq
            if not entry.samples or seq.is_finished:
                continue
            limit = draft_limit(seq, self.k, self.max_model_len) if speculates(seq) else 0
            seq.spec_token_ids = self.proposer.draft(seq, limit) if limit else []
