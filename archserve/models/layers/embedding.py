"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from archserve.models.layers.linear import WeightOnly, apply_linear_float

if TYPE_CHECKING:
    from archserve.kernels.linear.cpu_lm_head import HeadRoute


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
        # A lower-precision copy that multiplies some row counts faster (the CPU's 8-bit
        # head: kernels/linear/cpu_lm_head.py), installed at start-up; ``weight`` stays,
        # for the other row counts and the embedding it may be.
        self.low_precision: HeadRoute | None = None

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: where the logits may go (``apply_linear_float``); check the result."""
        route = self.low_precision
        if route is not None and route.takes(hidden):
            return route.logits(hidden)
        return apply_linear_float(hidden, self.weight, out)

    def install_low_precision(self, route: HeadRoute) -> None:
        """Multiply the row counts ``route`` takes by its copy; its tensors become this
        module's parameters, so memory accounting counts them."""
        self.low_precision = route
        for name, tensor in (("low_precision_weight", route.stored.q),
                             ("low_precision_scales", route.stored.scales)):
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def decode_bytes(self) -> int | None:
        """The bytes a one-row product reads where the low-precision copy serves it."""
        route = self.low_precision
        if route is None or 1 not in route.rows:
            return None
        return route.stored.nbytes()
