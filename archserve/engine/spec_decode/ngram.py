"""N-gram prompt lookup: draft the tokens that followed an earlier occurrence of the
sequence's newest n tokens.

For n from ``max_n`` down to ``min_n``, the newest n tokens are looked up among the
sequence's earlier n-grams; at the first n that occurs, the draft is the (up to) ``k``
tokens that followed its *first* occurrence (vLLM's choice: in a copy or an edit of a given
text, the first occurrence is in the prompt, where the original continues).

Each sequence keeps an index of its n-grams (``seq.extra``): n-gram -> the position right
after its first occurrence, extended by the tokens added since the last call, so a step
costs a few dict operations per token rather than a scan of the context.
"""

from __future__ import annotations

from archserve.engine.sequence import Sequence

_INDEX_KEY = "ngram_index"


class NgramIndex:
    """n-gram (as a tuple) -> end of its first occurrence, for n in [min_n, max_n]."""

    __slots__ = ("first_end", "num_indexed")

    def __init__(self) -> None:
        self.first_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0     # tokens whose n-grams ending there are in the index

    def extend(self, tokens: list[int], min_n: int, max_n: int, upto: int) -> None:
        """Index the n-grams ``tokens[end - n:end]`` for each ``end`` up to ``upto`` not
        indexed yet."""
        first_end = self.first_end
        for end in range(max(self.num_indexed, min_n), upto + 1):
            for n in range(min_n, min(max_n, end) + 1):
                first_end.setdefault(tuple(tokens[end - n:end]), end)
        self.num_indexed = max(self.num_indexed, upto + 1)


class NgramProposer:
    """Drafts by prompt lookup; no model, no device work."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, spans: list, target_hidden=None) -> None:  # noqa: ANN001
        """Set the drafts of the step's sequences that sampled (drafter.StepSpan's)."""
        for span in spans:
            if span.sampled:
                span.seq.spec_token_ids = self.draft(span.seq, span.limit) if span.limit else []

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``seq``'s tokens."""
        k = min(self.k, limit)
        tokens = seq.token_ids
        total = len(tokens)
        if k <= 0 or total <= self.min_n:
            return []
        index = seq.extra.get(_INDEX_KEY)
        if index is None:
            index = seq.extra[_INDEX_KEY] = NgramIndex()
        # The newest n-gram must be looked up before it is indexed: its own occurrence
        # would match it, with nothing after it to draft.
        index.extend(tokens, self.min_n, self.max_n, total - 1)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = index.first_end.get(tuple(tokens[total - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []
