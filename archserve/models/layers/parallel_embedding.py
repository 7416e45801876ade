"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous part of the
vocabulary's rows (``distributed.layout.vocab_part``).

The embedding looks up the ids in its part, zeroes the others and all-reduces; the LM head
computes its part's logits and all-gathers them, so sampling sees the whole vocabulary
once. Both answer the loader with the checkpoint's whole shape (``checkpoint_shape``) and
keep their rows of it (``load_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from archserve.distributed.layout import vocab_part
from archserve.distributed.parallel_state import get_tp
from archserve.models.layers.embedding import LMHead, VocabEmbedding
from archserve.models.layers.linear import apply_linear


class _VocabRows:
    """The rows ``[first_token, first_token + num_rows)`` of a [vocab, hidden] matrix,
    padded to ``weight.shape[0]`` rows."""

    def _split_vocab(self, vocab_size: int) -> int:
        self.tp = get_tp()
        self.vocab_size = vocab_size
        self.first_token, self.num_rows, allocated = vocab_part(vocab_size, self.tp.size,
                                                                self.tp.rank)
        return allocated

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    @torch.no_grad()
    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        self.weight[:self.num_rows].copy_(tensor[self.first_token:self.first_token + self.num_rows])
        self.weight[self.num_rows:].zero_()


class VocabParallelEmbedding(_VocabRows, VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        allocated = self._split_vocab(vocab_size)
        super().__init__(allocated, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_token
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabRows, LMHead):
    def __init__(self, vocab_size: int, hidden_size: int,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        allocated = self._split_vocab(vocab_size)
        super().__init__(allocated, hidden_size, tied_to)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(hidden, out)
        local = apply_linear(hidden, self.weight)
        return self.tp.all_gather_last(local)[..., :self.vocab_size].float()
