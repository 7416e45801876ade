"""The rows the sampler reads in a step: one per sequence, and where a sequence verifies
drafts (speculative decoding, engine/spec_decode/verification.py) one more per draft, each
seen as the sequence would be with the drafts before it already output."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from archserve.engine.sequence import Sequence


class DraftRow:
    """The sequence as the sampler sees it at the row after its first ``j`` drafts
    (the attributes ``SamplingBatch.from_sequences`` reads)."""

    __slots__ = ("seq", "drafts")

    def __init__(self, seq: Sequence, drafts: SequenceOf[int]) -> None:
        self.seq = seq
        self.drafts = drafts

    @property
    def sampling_params(self):  # noqa: ANN201 - the sequence's SamplingParams
        return self.seq.sampling_params

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def extra(self) -> dict:
        grammar = self.seq.extra.get("grammar")
        if grammar is None:
            return self.seq.extra
        # Its own grammar state: the sequence's matcher forked past the drafts before it.
        return {**self.seq.extra, "grammar": grammar.after(list(self.drafts))}

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        # Built on demand: only penalties read the values.
        return [*self.seq.output_token_ids, *self.drafts]


def sampler_rows(seqs: SequenceOf[Sequence], drafts: SequenceOf[SequenceOf[int]]) -> list:
    """One entry per logits row, in row order: a sequence without drafts is its own row;
    one with k drafts has k + 1 rows (``DraftRow`` after 0..k drafts)."""
    rows: list = []
    for seq, draft in zip(seqs, drafts, strict=True):
        rows.append(seq)
        rows.extend(DraftRow(seq, draft[:j]) for j in range(1, len(draft) + 1))
    return rows
