"""How the drafter reads a step through MTP layers (models/deepseek_mtp.py).

An MTP layer's row at position i reads the target's hidden state of position i and the
token at i + 1, and predicts the token at i + 2. Over a finished step its rows are the
positions the step made certain, [start, num_computed_tokens): each with the target's
hidden state from that step and the token after it (the last one the newly sampled
token). The last row predicts the first draft; a chained forward at position
num_computed_tokens - 1 + j reads draft j and the MTP layer's own previous output.
"""

from __future__ import annotations

import torch

from archserve.engine.batch import Span
from archserve.engine.sequence import Sequence
from archserve.engine.spec_decode.drafter import DraftNetwork, StepSpan


class MTPNetwork(DraftNetwork):
    reads_target_hidden = True

    def mirror_span(self, span: StepSpan, target_hidden: torch.Tensor | None
                    ) -> tuple[Span, list[int]]:
        seq = span.seq
        end = seq.num_computed_tokens
        count = end - span.start
        return (Span(seq.block_table, span.start, seq.token_ids[span.start + 1:end + 1],
                     1 if span.sampled and span.limit else 0),
                list(range(span.row, span.row + count)))

    def chain_position(self, seq: Sequence, j: int) -> int:
        return seq.num_computed_tokens - 1 + j

    def before_forward(self, hidden_rows: torch.Tensor) -> None:
        model = self.runner.model
        model.current = 0
        model.previous_hidden[:hidden_rows.shape[0]].copy_(hidden_rows)

    def before_chain(self, rows: torch.Tensor | None, count: int) -> None:
        model = self.runner.model
        source = model.output_hidden[rows] if rows is not None else model.output_hidden[:count]
        model.previous_hidden[:count].copy_(source)
        model.current = (model.current + 1) % len(model.layers)
