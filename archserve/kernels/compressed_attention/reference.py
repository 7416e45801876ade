"""DeepSeek V4's attention in plain PyTorch, over the paged cache of layout.py: the oracle of
the Triton kernels and the CPU path (TORCH_REFERENCE).

Per layer and step, for each sequence whose step covers positions [start, end):

1. compress (compressed layers): each group of ``rate`` tokens that completes becomes an
   entry, the softmax (over its tokens, per channel) of the gates plus the position bias
   weighing the projections, normalised (the compressor's RMSNorm) and rotated at the
   group's first position; a compressed sparse layer's entry g weighs group g - 1's first
   series with group g's second, and its indexer's keys are compressed the same way. A
   group the step leaves open keeps its accumulators in its block, closing it picks them up;
2. select (compressed sparse layers): each query row's indexer scores over the entries that
   are complete at its position, and its ``index_topk`` best (every entry where it sees no
   more);
3. attend: each query over the keys of its window (its sequence's ring before the step,
   this step's own keys after), its selected entries (every complete entry on heavily
   compressed layers) and its sink, one softmax;
4. keep the step's keys in the ring at their slots (after attending: a key takes the row
   of the key one window before it, which the step's first queries may still read).

A query at position q sees entry g once the group is complete: (g + 1) * rate <= q + 1.
"""

from __future__ import annotations

import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.reference import scheduled_sequences
from archserve.kernels.compressed_attention.interface import (
    CompressedLayerParams,
    CompressedStepInputs,
)
from archserve.kernels.compressed_attention.layout import (
    CLOSED_NEXT,
    OPEN_NEXT,
    OPEN_OWN,
    CompressedCacheLayout,
)
from archserve.kernels.elementwise.reference import rope_cos_sin, rotate_interleaved
from archserve.kernels.sparse_mla.reference import index_scores, select_topk

Accumulator = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (max, sum exp, weighted sum)
ROW_CHUNK = 128        # query rows attended at once (their keys gathered together)


def empty_accumulator(channels: int, device: torch.device) -> Accumulator:
    return (torch.full((channels,), float("-inf"), device=device),
            torch.zeros(channels, device=device), torch.zeros(channels, device=device))


def accumulate(values: torch.Tensor, gates: torch.Tensor) -> Accumulator:
    """The accumulator of tokens' values and gates [n, C] (fp32); n may be 0."""
    if values.shape[0] == 0:
        return empty_accumulator(values.shape[1], values.device)
    peak = gates.max(dim=0).values
    weights = torch.exp(gates - peak)
    return peak, weights.sum(dim=0), (weights * values).sum(dim=0)


def merge(a: Accumulator, b: Accumulator) -> Accumulator:
    peak = torch.maximum(a[0], b[0])
    safe = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    wa, wb = torch.exp(a[0] - safe), torch.exp(b[0] - safe)
    return peak, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
             ) -> torch.Tensor:
    """RMSNorm in fp32, in ``dtype`` (the compressors' norm)."""
    x = x.float()
    return (weight.float() * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).to(dtype)


class _Compressor:
    """The compressor of one layer over one step (step tensors already in fp32)."""

    def __init__(self, layout: CompressedCacheLayout, layer: CompressedLayerParams,
                 kv_cache: torch.Tensor, inputs: CompressedStepInputs) -> None:
        c = layer.compressor
        self.layout, self.layer, self.rate = layout, layer, c.rate
        self.d, self.di = layout.head_dim, layout.index_dim
        self.state = layout.state_view(kv_cache)
        self.entries = layout.entry_view(kv_cache)
        self.index_keys = layout.index_view(kv_cache) if self.di else None
        # Per token, per series: values and gates with the position bias (not yet added:
        # it depends on the position), main channels then the indexer's.
        self.kv = [inputs.compressor_kv.float()]
        self.gate = [inputs.compressor_gate.float()]
        self.bias = [c.position_bias.float()]
        if self.di:
            self.kv.append(inputs.index_kv.float())
            self.gate.append(inputs.index_gate.float())
            self.bias.append(c.index_position_bias.float())

    def series(self, rows: slice, positions: torch.Tensor, which: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, gates + bias) [n, C] of one series (0: the first, 1: the second; a
        layer without overlap has one) of the step's rows."""
        values, gates = [], []
        for kv, gate, bias in zip(self.kv, self.gate, self.bias, strict=True):
            width = kv.shape[1] // (2 if self.layout.overlap else 1)
            cols = slice(which * width, (which + 1) * width)
            values.append(kv[rows, cols])
            gates.append(gate[rows, cols] + bias[positions % self.rate][:, cols])
        return torch.cat(values, dim=1), torch.cat(gates, dim=1)

    def emit(self, table: torch.Tensor, group: int, acc: Accumulator, dtype: torch.dtype
             ) -> None:
        value = acc[2] / acc[1]
        c, layer = self.layer.compressor, self.layer
        position = group * self.rate
        cos, sin = rope_cos_sin(torch.tensor(position, device=value.device), layer.inv_freq)
        block, row = self._block(table, group), group % self.layout.entries_per_block
        entry = rms_norm(value[:self.d], c.norm_weight, layer.eps, dtype)
        self.entries[block, row] = rotate_interleaved(entry, cos, sin)
        if self.di:
            key = rms_norm(value[self.d:], c.index_norm_weight, layer.eps, dtype)
            self.index_keys[block, row] = rotate_interleaved(key, cos, sin)

    def _block(self, table: torch.Tensor, group: int) -> int:
        return int(table[group * self.rate // self.layout.block_size])

    def load(self, table: torch.Tensor, group: int, slot: int) -> Accumulator:
        peak, total, weighted = self.state[self._block(table, group), slot]
        return peak.clone(), total.clone(), weighted.clone()

    def store(self, table: torch.Tensor, group: int, slot: int, acc: Accumulator) -> None:
        self.state[self._block(table, group), slot] = torch.stack(acc)

    def step(self, table: torch.Tensor, rows: slice, start: int, end: int,
             dtype: torch.dtype) -> None:
        """Compress positions [start, end) of one sequence (the step's rows ``rows``)."""
        m, overlap = self.rate, self.layout.overlap
        positions = torch.arange(start, end, device=table.device)
        first, last = start // m, (end - 1) // m
        own_slot = OPEN_OWN if overlap else 0
        prev_next: Accumulator | None = None     # the first series of the group before
        for g in range(first, last + 1):
            lo, hi = max(g * m, start), min((g + 1) * m, end)
            sub = slice(rows.start + lo - start, rows.start + hi - start)
            fresh = positions[lo - start:hi - start]
            began_before = g * m < start
            own = accumulate(*self.series(sub, fresh, 1 if overlap else 0))
            if began_before:
                own = merge(self.load(table, g, own_slot), own)
            nxt = None
            if overlap:
                nxt = accumulate(*self.series(sub, fresh, 0))
                if began_before:
                    nxt = merge(self.load(table, g, OPEN_NEXT), nxt)
                if prev_next is None:      # group g - 1 closed in an earlier step
                    prev_next = (self.load(table, g - 1, CLOSED_NEXT) if g > 0 else
                                 empty_accumulator(own[0].shape[0], table.device))
            complete = hi == (g + 1) * m
            if complete:
                self.emit(table, g, merge(prev_next, own) if overlap else own, dtype)
                # A block keeps the first series of its latest closed group: the next
                # group (in it or in the next block) mixes it in, whichever step or
                # sequence (the prefix cache) computes that group.
                closes_block = (g + 1) * m % self.layout.block_size == 0
                if overlap and (g == last or closes_block
                                or (g + 1 == last and end < (g + 2) * m)):
                    self.store(table, g, CLOSED_NEXT, nxt)
            elif g == last:       # an open group: what the next step needs of it
                self.store(table, g, own_slot, own)
                if overlap:
                    self.store(table, g, OPEN_NEXT, nxt)
            prev_next = nxt


def ring_start(layout: CompressedCacheLayout, slot: int) -> int:
    """The first row of the ring that a token's slot is in (a padding token's slot, -1:
    ring 0, which such a token reads nothing of)."""
    return max(slot, 0) // layout.ring_rows * layout.ring_rows


def window_keys(layout: CompressedCacheLayout, ring_cache: torch.Tensor, ring: int,
                positions: torch.Tensor) -> torch.Tensor:
    """The cached keys [n, head_dim] of ``positions`` (within a window of the step) in the
    ring starting at row ``ring``."""
    return layout.ring_view(ring_cache)[ring + positions % layout.ring_rows]


def compressed_entries(layout: CompressedCacheLayout, kv_cache: torch.Tensor,
                       table: torch.Tensor, entries: torch.Tensor, index: bool = False
                       ) -> torch.Tensor:
    """Entries [n, head_dim] (or with ``index`` their index keys) by entry number."""
    per_block = layout.entries_per_block
    view = layout.index_view(kv_cache) if index else layout.entry_view(kv_cache)
    return view[table.long()[entries // per_block], entries % per_block]


def write_window(layout: CompressedCacheLayout, ring_cache: torch.Tensor, kv: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Keep one sequence's step keys [n, head_dim] at their ``slots`` [n]: the latest
    ring_rows only (an earlier one's row is a later one's), none at slot -1 (padding)."""
    keep = slots[-layout.ring_rows:]
    view = layout.ring_view(ring_cache)
    live = keep >= 0
    view[keep[live]] = kv[-layout.ring_rows:][live].to(view.dtype)


def attend_one(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
               sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """query [Q, H, D] over keys [Q, K, D] (per row; also the values) where ``mask`` [Q, K],
    with a sink logit per head -> [Q, H, D] fp32."""
    scores = torch.einsum("qhd,qkd->qhk", query.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    logits = torch.cat((scores, sinks.float()[None, :, None].expand(*scores.shape[:2], 1)), -1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("qhk,qkd->qhd", probs, keys.float())


def selected_entries(layout: CompressedCacheLayout, layer: CompressedLayerParams,
                     kv_cache: torch.Tensor, table: torch.Tensor, inputs: CompressedStepInputs,
                     rows: slice, positions: torch.Tensor) -> torch.Tensor:
    """Each query row's entries [Q, k]: the indexer's top-k (compressed sparse layers) or
    every complete one (heavily compressed), -1 after them."""
    visible = (positions + 1) // layer.rate
    longest = int(visible.max()) if visible.numel() else 0
    if not layout.index_dim:
        entries = torch.arange(longest, device=positions.device).expand(len(positions), -1)
        return torch.where(entries < visible[:, None], entries, -1)
    if longest <= layer.index_topk:      # every row sees at most top-k: all of them
        return select_topk(positions.new_empty(len(positions), 0).float(), visible,
                           layer.index_topk).long()
    keys = compressed_entries(layout, kv_cache, table,
                              torch.arange(longest, device=positions.device), index=True)
    scores = index_scores(inputs.index_query[rows], inputs.index_weights[rows], keys)
    return select_topk(scores, visible, layer.index_topk).long()


def forward_compressed(layout: CompressedCacheLayout, layer: CompressedLayerParams,
                       inputs: CompressedStepInputs, kv_cache: torch.Tensor,
                       ring_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The CompressedAttentionImpl contract (interface.py), in fp32 torch."""
    query, kv = inputs.query, inputs.kv
    out = torch.empty_like(query)
    for i, q_start, q_end, seq_len in scheduled_sequences(meta):
        table = meta.block_tables[i]
        start, rows = seq_len - (q_end - q_start), slice(q_start, q_end)
        if layer.compressor is not None:
            _Compressor(layout, layer, kv_cache, inputs).step(table, rows, start, seq_len,
                                                             kv.dtype)
        positions = torch.arange(start, seq_len, device=query.device)
        # The window: cached keys before the step, then the step's own.
        first = max(0, start - layer.window + 1)
        ring = ring_start(layout, int(meta.slot_mapping[q_start]))
        cached = window_keys(layout, ring_cache, ring,
                             torch.arange(first, start, device=query.device))
        keys = torch.cat((cached.to(kv.dtype), kv[rows]), dim=0)
        key_pos = torch.arange(first, seq_len, device=query.device)
        chosen = (selected_entries(layout, layer, kv_cache, table, inputs, rows, positions)
                  if layer.compressor is not None else None)
        # Rows a chunk at a time: each chunk's keys are its window's span and its entries.
        for lo in range(0, len(positions), ROW_CHUNK):
            hi = min(lo + ROW_CHUNK, len(positions))
            pos = positions[lo:hi]
            span = slice(max(0, int(pos[0]) - layer.window + 1 - first), int(pos[-1]) + 1 - first)
            window = key_pos[span]
            mask = (window[None, :] <= pos[:, None]) & (window[None, :] > pos[:, None]
                                                       - layer.window)
            all_keys = keys[span].expand(hi - lo, -1, -1)
            if chosen is not None:
                entries = compressed_entries(layout, kv_cache, table, chosen[lo:hi].clamp(min=0))
                all_keys = torch.cat((all_keys, entries.to(kv.dtype)), dim=1)
                mask = torch.cat((mask, chosen[lo:hi] >= 0), dim=1)
            out[q_start + lo:q_start + hi] = attend_one(query[q_start + lo:q_start + hi],
                                                        all_keys, mask, layer.sinks,
                                                        layer.scale).to(query.dtype)
        write_window(layout, ring_cache, kv[rows], meta.slot_mapping[rows])
    return out
