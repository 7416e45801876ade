"""Verification: one forward of the target over a sequence's newest token and its drafts,
a token drawn at every row, and the drafts accepted while they equal those draws.

A sequence with drafts d_1..d_k is scheduled with the k + 1 inputs [t, d_1, ..., d_k]; row
j's logits give the target's distribution p_j of the token after d_j (row 0's after t).
The sampler draws x_j ~ p_j for every row, each row processed as if d_1..d_j were already
outputs (engine/sample_rows.py's ``DraftRow``: penalties count them, min_tokens and a
seeded row's draw key see their positions, a grammar's matcher is forked past them). Then d_1..d_a are accepted for the longest run with x_{j-1} = d_j, and
x_a is the step's last token: the bonus token when every draft was accepted, else the
target's own token where the first draft failed. A step yields 1 to k + 1 tokens.

This is speculative sampling's rejection rule for a deterministic proposal (every method
here drafts a point mass q = delta(d)): accepting d with probability min(1, p(d)/q(d)) =
p(d), and on rejection drawing from max(0, p - q) renormalised = p without d, is the same
as drawing x ~ p and accepting iff x = d. So each output token has exactly the target's
distribution; greedy rows accept while the draft is the argmax; and a seeded row draws
what it would draw without speculation, so its tokens are identical.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field


def num_accepted(drawn: SequenceOf[int], draft: SequenceOf[int]) -> int:
    """How many drafts are accepted: the leading run with drawn[j] == draft[j]."""
    count = 0
    for x, d in zip(drawn, draft, strict=False):
        if x != d:
            break
        count += 1
    return count


@dataclass
class SpecDecodingStats:
    """Counts since the engine started, vLLM's ``spec_decode_*`` metrics: drafts verified
    (sequences that had any), draft tokens, accepted ones, and accepted ones by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence gets per step, the bonus token included (vLLM's
        convention): 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                    if self.num_draft_tokens else 0.0)}
