"""Verification over a target whose cache is not keyed by position alone (DeepSeek V4:
kernels/compressed_attention/layout.py): a rejected draft's writes are undone.

A verification step writes its drafts into the cache before they are accepted. Compressed
entries and index keys sit at their group's number and are written again when the group is
computed again, and no query sees an entry before its group is complete. Two writes are not
overwritten that way:

- the window ring: a key at position q takes the row of the key at q - window, which the
  windows of positions q - window + 1 .. q - 1 still read; a rejected draft's key would
  stand in for one the next steps need;
- the compressor's running sums: each token joins its open group's accumulators (one set
  per block and series), and a rejected draft's share cannot be taken out again (an online
  softmax's merge has no inverse), nor can the sums be cut back to a point inside the step.

So before a step that verifies drafts, the rows it may overwrite are saved: each drafting
sequence's ring rows at the step's positions and the compressor state of the blocks those
positions fall in. Where a sequence's drafts are all accepted, its step stands. Where one is
rejected, the rows are restored and the sequence rewound to the step's first position:
the next step computes its newest token and the accepted drafts again, beside the token the
verification gave, as a prompt chunk would (a step of at most k + 2 tokens that drafts
nothing). The rewound blocks' prefix-cache registrations go too (``uncache_uncomputed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archserve.engine.block_pool import KVBlockPool
from archserve.engine.kv_cache import compressed_layouts
from archserve.engine.scheduler import SchedulerOutput
from archserve.engine.sequence import SequenceStatus


@dataclass
class _Saved:
    """One drafting sequence's step: its positions [start, end), and where its rows sit in
    the saved tensors (blocks [b0, b1), ring slots [s0, s1))."""

    start: int
    end: int
    blocks: tuple[int, int]
    slots: tuple[int, int]


class CompressedCacheRollback:
    def __init__(self, model_config, kv_caches: list[torch.Tensor], block_pool: KVBlockPool
                 ) -> None:
        n = model_config.num_layers
        self.block_caches, self.rings = kv_caches[:n], kv_caches[n:]
        self.layouts = compressed_layouts(model_config, self.rings[0].dtype,
                                          block_pool.block_size)
        self.block_pool = block_pool
        self._saved: dict[int, _Saved] = {}
        self._block_ids = self._slot_ids = None
        self._states: list[torch.Tensor | None] = []
        self._keys: list[torch.Tensor] = []

    def save(self, out: SchedulerOutput) -> None:
        """Keep what ``out``'s verifications may overwrite (call before its forward)."""
        self._saved = {}
        block_ids: list[int] = []
        slot_ids: list[int] = []
        bs = self.block_pool.block_size
        for entry in out.scheduled:
            if not entry.draft_token_ids:
                continue
            seq = entry.seq
            start = seq.num_computed_tokens
            end = start + entry.num_new_tokens
            blocks = seq.block_table[start // bs:(end - 1) // bs + 1]
            self._saved[seq.seq_id] = _Saved(
                start, end, (len(block_ids), len(block_ids) + len(blocks)),
                (len(slot_ids), len(slot_ids) + end - start))
            block_ids += blocks
            slot_ids += self.block_pool.slots_for(seq, start, end)
        if not self._saved:
            return
        device = self.rings[0].device
        self._block_ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        self._slot_ids = torch.tensor(slot_ids, dtype=torch.long, device=device)
        self._states = [layout.state_view(cache)[self._block_ids] if layout.state_slots
                        else None
                        for layout, cache in zip(self.layouts, self.block_caches, strict=True)]
        self._keys = [layout.ring_view(ring)[self._slot_ids]
                      for layout, ring in zip(self.layouts, self.rings, strict=True)]

    def rewind_rejected(self, out: SchedulerOutput) -> None:
        """After ``out`` resolved: restore the rows of every sequence of it that had a draft
        rejected, and rewind it to its step's first position."""
        saved, self._saved = self._saved, {}
        blocks: list[int] = []
        slots: list[int] = []
        for entry in out.scheduled:
            step = saved.get(entry.seq.seq_id)
            seq = entry.seq
            if step is None or seq.status is not SequenceStatus.RUNNING \
                    or seq.num_computed_tokens >= step.end:
                continue    # finished (its blocks are gone), or every draft accepted
            blocks += range(*step.blocks)
            slots += range(*step.slots)
            seq.num_computed_tokens = step.start
            self.block_pool.uncache_uncomputed(seq)
        if not slots:
            return
        device = self.rings[0].device
        rows = torch.tensor(blocks, dtype=torch.long, device=device)
        keys = torch.tensor(slots, dtype=torch.long, device=device)
        block_ids, slot_ids = self._block_ids[rows], self._slot_ids[keys]
        for layout, cache, ring, state, key in zip(self.layouts, self.block_caches, self.rings,
                                                   self._states, self._keys, strict=True):
            if state is not None:
                layout.state_view(cache)[block_ids] = state[rows]
            layout.ring_view(ring)[slot_ids] = key[keys]
