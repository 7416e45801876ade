"""A model that drafts: a small draft model, or the target checkpoint's MTP layers.

The draft network runs in a ModelRunner of its own (its weights, its attention, its CUDA
graphs) whose KV cache uses the target's block ids: the draft's cache for a token sits
in the same slot as the target's, so the block pool, prefix caching and preemption need
no bookkeeping of their own. The invariant: wherever the target's cache holds a token's
keys and values (positions below ``num_computed_tokens``), the draft's does too, computed
from the same tokens.

After every step the drafter runs the draft network over the step's inputs that are now
certain (its prompt chunks; of a verification, the newest token and the accepted drafts),
which keeps the invariant; for a sequence that sampled, that forward's last row gives the
first draft, and k - 1 one-token forwards chain the rest. Drafts are greedy (the draft's
argmax): the target's verification treats them as a point mass (verification.py).

Where the invariant bends, only the drafts' quality can suffer, never an output (the target
verifies every draft): a block the prefix cache hands another sequence holds the draft's
entries of the sequence that computed it, and an MTP layer's entry at a block's last
position was computed with that sequence's next token; a sequence that finishes in a step
is not levelled, so the blocks it completed there keep the draft's earlier entries.

What differs between the two kinds of draft network is ``DraftNetwork``'s:
- a draft model reads each token at its own position and predicts the next one;
- an MTP layer reads, at position i, the target's hidden state of position i and the token
  at i + 1, and predicts the token at i + 2; chained, it reads its own previous output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from archserve.engine.batch import Span, build_span_batch, host_to_device
from archserve.engine.block_pool import KVBlockPool
from archserve.engine.sampler import greedy_argmax
from archserve.engine.sequence import Sequence

log = logging.getLogger("archserve")


@dataclass
class StepSpan:
    """One sequence of a finished step, as the drafter sees it: its inputs of that step
    that are certain start at ``start``; the step's hidden states of them start at row
    ``row`` (of the target's step); ``limit``: drafts to propose (0: none)."""

    seq: Sequence
    start: int
    row: int
    sampled: bool
    limit: int


class DraftNetwork:
    """How a draft network reads a step (the draft model's way; MTP overrides)."""

    reads_target_hidden = False

    def __init__(self, runner) -> None:  # noqa: ANN001 - the draft's ModelRunner
        self.runner = runner

    def mirror_span(self, span: StepSpan, target_hidden: torch.Tensor | None
                    ) -> tuple[Span, list[int]]:
        """The draft forward's inputs for ``span`` (the step's certain inputs, and the new
        token where it sampled: the draft predicts from it), and the target's hidden rows
        it reads (none here)."""
        seq = span.seq
        end = seq.num_computed_tokens + (1 if span.sampled and span.limit else 0)
        return Span(seq.block_table, span.start, seq.token_ids[span.start:end],
                    1 if span.sampled and span.limit else 0), []

    def chain_position(self, seq: Sequence, j: int) -> int:
        """The position of the j-th chained forward's input (j >= 1): draft j itself."""
        return seq.num_computed_tokens + j

    def before_forward(self, hidden_rows: torch.Tensor) -> None:
        """Hand the mirror forward the target's hidden states of its rows (MTP only)."""

    def before_chain(self, rows: torch.Tensor | None, count: int) -> None:
        """Hand a chained forward of ``count`` rows what it reads of the previous
        forward's output rows ``rows`` (None: its first ``count``, in order); nothing
        here."""


class ModelDrafter:
    """Proposes drafts with a draft network (``network``) after every step."""

    def __init__(self, network: DraftNetwork, num_tokens: int) -> None:
        self.network = network
        self.runner = network.runner
        self.k = num_tokens
        self.block_pool: KVBlockPool | None = None    # the engine's: set when it is built

    @torch.inference_mode()
    def propose(self, spans: list[StepSpan], target_hidden: torch.Tensor | None) -> None:
        """Keep the draft's cache level with the target's over the step's ``spans``, and
        set the drafts of those that sampled (``Sequence.spec_token_ids``)."""
        for span in spans:
            if span.sampled:
                span.seq.spec_token_ids = []
                span.limit = self._reserve(span.seq, span.limit)
        mirrored = [(span, *self.network.mirror_span(span, target_hidden)) for span in spans]
        mirrored = [(span, piece, rows) for span, piece, rows in mirrored if piece.tokens]
        if not mirrored:
            return
        runner = self.runner
        batch = build_span_batch([piece for _, piece, _ in mirrored], runner.block_size,
                                 runner.staging)
        if self.network.reads_target_hidden:
            rows = [r for _, _, span_rows in mirrored for r in span_rows]
            self.network.before_forward(target_hidden[host_to_device(
                np.asarray(rows, dtype=np.int64), target_hidden.device)])
        logits, _ = runner.forward(batch)
        if logits is None:
            return
        drafting = [span for span, piece, _ in mirrored if piece.sampled_rows]
        tokens = greedy_argmax(logits)
        # Each step's drafts (a device tensor) with the ``drafting`` index of each row.
        steps = [(tokens, list(range(len(drafting))))]
        source = batch.logits_indices          # the rows a chained forward continues from
        for j in range(1, max(span.limit for span in drafting)):
            active = steps[-1][1]
            keep = [p for p, i in enumerate(active) if drafting[i].limit > j]
            if not keep:
                break
            if len(keep) < len(active):
                select = host_to_device(np.asarray(keep, dtype=np.int64), tokens.device)
                tokens = tokens[select]
                source = select if source is None else source[select]
            owners = [active[p] for p in keep]
            self.network.before_chain(source, len(owners))
            batch = build_span_batch(
                [Span(drafting[i].seq.block_table,
                      self.network.chain_position(drafting[i].seq, j), [0], 1)
                 for i in owners], runner.block_size, runner.staging)
            batch.fed_ids = tokens
            logits, _ = runner.forward(batch)
            tokens = greedy_argmax(logits)
            steps.append((tokens, owners))
            source = None
        host = torch.cat([t for t, _ in steps]).tolist()   # one copy for the step's drafts
        offset = 0
        for _, owners in steps:
            for r, i in enumerate(owners):
                drafting[i].seq.spec_token_ids.append(host[offset + r])
            offset += len(owners)

    def _reserve(self, seq: Sequence, limit: int) -> int:
        """Blocks for the positions the drafts' forwards write (the new token's and the
        chained drafts'), which the next verification needs anyway; fewer drafts where the
        pool is short (0: none)."""
        for count in range(limit, 0, -1):
            if self.block_pool.append_slots(seq, count):
                return count
        return 0
