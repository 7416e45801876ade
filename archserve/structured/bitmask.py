"""Per-sequence grammar state and the per-step token mask of the constrained rows.

Each constrained sequence holds a ``GrammarState`` (a matcher over its compiled
grammar). Before a step samples, the state catches up with the tokens its sequence has
accepted since the previous step (so preemption, recomputation and asynchronous
scheduling need no bookkeeping of their own), then the matchers fill one packed bitmask
(1 bit per token, int32 words, xgrammar's layout) for the constrained rows only. The
sampler applies it to those rows' logits; free rows are never touched.

EOS is in a mask only where the grammar may end, so a constrained sequence finishes when
its grammar does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

log = logging.getLogger("archserve")

_BATCH_FILL_MIN_ROWS = 8     # below this the thread pool costs more than it saves
_batch_matcher = None


class GrammarState:
    """One sequence's position in its grammar.

    Holds the compilation's future: the scheduler admits the sequence once it is done
    (``Sequence.gate``), so the matcher is made on the first step that samples.
    """

    __slots__ = ("compiled", "_matcher", "num_consumed", "failed")

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self._matcher = None
        self.num_consumed = 0          # output tokens the matcher has accepted
        self.failed = False            # a token outside the grammar arrived

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def fail(self, why: str) -> None:
        """From now on only stop tokens are allowed: the sequence ends at its next token
        instead of failing the step for the whole batch."""
        if not self.failed:
            log.warning("%s; the sequence can only stop", why)
        self.failed = True

    def catch_up(self, output_token_ids: list[int],
                 pending_value: Callable[[], int] | None = None) -> None:
        """Accept the sequence's output tokens the matcher has not seen yet.

        A pending token (asynchronous scheduling: sampled by the step still in flight)
        is read through ``pending_value``, which waits for that step's copy to land.
        """
        for token in output_token_ids[self.num_consumed:]:
            if token < 0:
                if pending_value is None:
                    raise RuntimeError("a constrained sequence reached sampling with a "
                                       "pending token and no step to read it from")
                token = pending_value()
            if not self.failed:
                try:
                    matcher = self.matcher
                    # Only a stop token the grammar did not offer is refused (min_tokens,
                    # ignore_eos).
                    if not matcher.is_terminated() and not matcher.accept_token(token):
                        self.fail(f"token {token} is outside the grammar")
                except Exception as exc:  # noqa: BLE001 - one row's grammar, not the step
                    self.fail(f"the grammar failed: {type(exc).__name__}: {exc}")
            self.num_consumed += 1

    @property
    def is_terminated(self) -> bool:
        if self.failed:
            return True
        try:
            return self.matcher.is_terminated()
        except Exception as exc:  # noqa: BLE001
            self.fail(f"the grammar failed: {type(exc).__name__}: {exc}")
            return True


    def after(self, drafts: list[int]) -> DraftedGrammar:
        """The state after the sequence's outputs and ``drafts`` (speculative decoding: the
        row that verifies the next draft), this state untouched."""
        return DraftedGrammar(self, drafts)


class DraftedGrammar:
    """A grammar's state after a sequence's drafts, as ``GrammarState`` presents it to the
    sampler: a fork of the sequence's matcher, advanced over the drafts. A draft outside
    the grammar leaves only stop tokens: the row before it cannot draw that draft (its mask
    forbids it), so the draft is rejected and this row's token is never used."""

    __slots__ = ("base", "drafts", "_matcher", "failed")

    def __init__(self, base: GrammarState, drafts: list[int]) -> None:
        self.base = base
        self.drafts = drafts
        self._matcher = None
        self.failed = False

    def catch_up(self, output_token_ids: list[int],
                 pending_value: Callable[[], int] | None = None) -> None:
        """``output_token_ids`` end with the drafts: the sequence's state catches up with
        what comes before them, then a fork of it takes the drafts."""
        self.base.catch_up(output_token_ids[:len(output_token_ids) - len(self.drafts)],
                           pending_value)
        self.failed = self.base.failed
        if self.failed:
            return
        matcher = self.base.matcher.fork()
        for token in self.drafts:
            if not matcher.is_terminated() and not matcher.accept_token(token):
                self.failed = True
                break
        self._matcher = matcher

    @property
    def matcher(self):  # noqa: ANN201 - an xgrammar GrammarMatcher
        return self._matcher

    def fail(self, why: str) -> None:
        self.failed = True

    @property
    def is_terminated(self) -> bool:
        return self.failed or self._matcher.is_terminated()


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _stop_only_row(vocab_size: int, stop_token_ids: list[int]) -> torch.Tensor:
    words = np.zeros(bitmask_width(vocab_size), dtype=np.uint32)
    for t in stop_token_ids:
        if t < vocab_size:
            words[t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def fill_bitmask(states: list[GrammarState], vocab_size: int,
                 stop_token_ids: list[int]) -> torch.Tensor:
    """int32 [len(states), ceil(V/32)] on the host: bit t of row i set where row i may
    sample token t. A row whose grammar ended, or failed, allows only stop tokens."""
    global _batch_matcher
    import xgrammar as xgr
    bitmask = torch.full((len(states), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    live = [i for i, s in enumerate(states) if not s.is_terminated]
    if len(live) >= _BATCH_FILL_MIN_ROWS:
        try:
            if _batch_matcher is None:
                _batch_matcher = xgr.BatchGrammarMatcher()
            _batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in live],
                                                         bitmask, live)
            live = []
        except Exception:  # noqa: BLE001 - row by row finds the row at fault
            log.exception("batch bitmask fill failed; filling row by row")
    for i in live:
        try:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        except Exception as exc:  # noqa: BLE001 - one row's grammar, not the step
            states[i].fail(f"the grammar failed: {type(exc).__name__}: {exc}")
    stop_only = [i for i, s in enumerate(states) if s.is_terminated]
    if stop_only:
        bitmask[stop_only] = _stop_only_row(vocab_size, stop_token_ids)
    return bitmask


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                  ) -> torch.Tensor:
    """Set to -inf the logits of ``rows`` whose bit in ``bitmask`` (on the logits' device,
    one row per entry of ``rows``) is clear. In place; returns ``logits``.

    Plain torch, so it runs wherever the logits are, outside any CUDA graph: the words
    are read as little-endian bytes and each byte expands to 8 booleans.
    """
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(8, dtype=torch.uint8,
                                                       device=logits.device)
    vocab = logits.shape[-1]
    num_rows = bitmask.shape[0]
    bits = (bitmask.contiguous().view(torch.uint8)[..., None] >> shifts) & 1
    allowed = bits.view(num_rows, -1)[:, :vocab].bool()
    if num_rows == logits.shape[0]:   # every row constrained (rows are sorted, unique)
        return logits.masked_fill_(~allowed, float("-inf"))
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
