"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archserve.models.layers.linear import WeightOnly, apply_linear_float


class VocabEmbedding(WeightOnly):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in float32 (sampling wants fp32)."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            # The same Parameter object: one copy in memory, loaded once, listed once.
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size),
                                       requires_grad=False)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: where the logits may go (``apply_linear_float``); check the result."""
        return apply_linear_float(hidden, self.weight, out)
