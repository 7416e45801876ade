"""Triton attention of DeepSeek V4's layers (the reference: reference.py's ``forward_compressed``
attend and window steps): each query row over its window's keys, its compressed entries and
its sinks, in one online softmax.

A row at position p has ``n_keys`` keys: its window, positions p - n_window + 1 .. p
(n_window = min(window, p + 1)), then its entries (every complete one on heavily compressed
layers; on compressed sparse ones the indexer's selection, a row of ``indices``). Key j of
the row is read from the cache (its sequence's ring row of its position, or an entry row of
a block) or, for a position the step itself brings, from the step's keys: the ring is
written after attending (``write_window_triton``), since a key takes the row of the key
one window before it. Every key is also the value (K = V), head_dim wide.

A program owns BLOCK_H query heads of one row (the heads are the dots' M side: every key
tile is read once for all of them) and one split of its keys; splits merge as the decode
kernel's do (kernels/attention/triton_decode.py: the sinks go to split 0). The grid comes
from host ints (rows, heads, the most keys a row may have), so a decode step is captured in
a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_decode import (
    choose_num_splits,
    decode_split_range,
    merge_splits,
    online_softmax_start,
    online_softmax_step,
    sink_start,
    split_partials,
    store_decode_output,
)
from archserve.kernels.compressed_attention.layout import CompressedCacheLayout
from archserve.kernels.triton_dot import dot_precision

BLOCK_H = 16            # tl.dot's smallest M; a [16, 512] fp32 accumulator fits 4 warps
BLOCK_N = 32
PROGRAMS_PER_SM = 2


@dataclass
class RowInputs:
    """Per query row (int32 [R]): its sequence (block-table row), position, the position its
    sequence's step starts at and that start's row of the step's tensors; ``index`` [R + 1]
    is 0, 1, .., R (each row its own "sequence" of keys for the split and merge helpers)."""

    seq: torch.Tensor
    position: torch.Tensor
    start: torch.Tensor
    fresh: torch.Tensor
    index: torch.Tensor

    def ring_starts(self, slot_mapping: torch.Tensor, ring_rows: int) -> torch.Tensor:
        """int64 [R]: the first row of each row's ring (its step's first token's slot
        rounded down to a ring; a padding token's slot, -1: ring 0, of which it reads
        nothing). Device ops: a decode graph records them."""
        slots = slot_mapping[self.fresh.long()].clamp(min=0)
        return torch.div(slots, ring_rows, rounding_mode="floor") * ring_rows


@triton.jit
def _attention_kernel(q_ptr, kv_ptr, rows_ptr, ring_ptr, block_tables_ptr, row_seq_ptr,
                      row_pos_ptr, row_start_ptr, row_fresh_ptr, row_ring_ptr,
                      key_counts_ptr, row_index_ptr,
                      indices_ptr, sinks_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
                      stride_q_row, stride_q_head, stride_kv, stride_out_row, stride_out_head,
                      stride_block_table, stride_indices, scale,
                      NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      WINDOW: tl.constexpr, RING_ROWS: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, RATE: tl.constexpr, PER_BLOCK: tl.constexpr,
                      BLOCK_ELEMS: tl.constexpr, ENTRY_OFF: tl.constexpr,
                      INDEXED: tl.constexpr, HEAD_BLOCK: tl.constexpr, TILE: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    head_block = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    # key_counts per row, row_index = 0, 1, 2 ...: each row is its own "sequence" of keys.
    token, query_len, lo, hi, _ = decode_split_range(row_index_ptr, key_counts_ptr, row,
                                                     split, 0, NUM_SPLITS, TILE)
    seq = tl.load(row_seq_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    start = tl.load(row_start_ptr + row)
    fresh0 = tl.load(row_fresh_ptr + row)
    ring = tl.load(row_ring_ptr + row)
    n_window = tl.minimum(pos + 1, WINDOW)
    first = pos - n_window + 1
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    index_row = indices_ptr + row.to(tl.int64) * stride_indices

    heads = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    mask_h = heads < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + token.to(tl.int64) * stride_q_row + heads[:, None] * stride_q_head
                + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if DOT_PRECISION == "ieee":
        q = q.to(tl.float32)
    acc, l_i, m_i = online_softmax_start(HEAD_BLOCK, BLOCK_D)
    l_i, m_i = sink_start(l_i, m_i, sinks_ptr, heads, mask_h, split)
    for tile in range(lo, hi, TILE):
        j = tile + tl.arange(0, TILE)
        live = j < hi
        in_window = j < n_window
        position = first + j
        fresh = in_window & (position >= start)
        # A window key: its ring's row; an entry: its block's entry row.
        entry = j - n_window
        if INDEXED:
            entry = tl.load(index_row + entry, mask=live & ~in_window, other=0)
        block = tl.load(table_row + (entry * RATE) // BLOCK_SIZE, mask=live & ~in_window,
                        other=0)
        entry_row = block.to(tl.int64) * BLOCK_ELEMS + ENTRY_OFF + (entry % PER_BLOCK) * D
        ring_row = (ring + position % RING_ROWS) * D
        ptrs = tl.where(fresh[:, None],
                        kv_ptr + (fresh0 + position - start).to(tl.int64)[:, None] * stride_kv,
                        tl.where(in_window[:, None], ring_ptr + ring_row[:, None],
                                 rows_ptr + entry_row[:, None])) + offs_d[None, :]
        keys = tl.load(ptrs, mask=live[:, None] & mask_d[None, :], other=0.0)
        keys = keys.to(q.dtype)
        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)
        scores = tl.where(live[None, :], scores * (scale * 1.4426950408889634), float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, keys, q.dtype, DOT_PRECISION)
    store_decode_output(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, token,
                        query_len, row, split, lo < hi, NUM_HEADS, heads, mask_h, offs_d,
                        mask_d, stride_out_row, stride_out_head, 1.0, D, NUM_SPLITS)


def attention_triton(layout: CompressedCacheLayout, query: torch.Tensor, kv: torch.Tensor,
                     kv_cache: torch.Tensor, ring_cache: torch.Tensor,
                     block_tables: torch.Tensor, sinks: torch.Tensor, scale: float,
                     rows: RowInputs, ring_starts: torch.Tensor, key_counts: torch.Tensor,
                     indices: torch.Tensor | None, max_keys: int, num_sms: int = 0
                     ) -> torch.Tensor:
    """query [R, H, D] (row r at ``rows.position[r]`` of block-table row ``rows.seq[r]``,
    its ring at row ``ring_starts[r]``), the step's keys ``kv`` [T, D] -> [R, H, D] in
    query's dtype. ``key_counts`` [R] int32:
    each row's window and entries; ``indices`` [R, k]: the rows' selected entries
    (compressed sparse); None: every complete entry. ``max_keys``, a host int, bounds any
    row's keys (the grid and the split rule)."""
    num_rows, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_rows == 0:
        return out
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    num_splits = choose_num_splits(num_rows, head_blocks, max_keys, num_sms, PROGRAMS_PER_SM)
    partial_out, partial_lse = split_partials(out, num_rows, num_heads, num_splits, head_dim)
    elem = layout.elem
    cache_rows = layout.block_span(kv_cache).view(layout.dtype)
    indexed = indices is not None
    _attention_kernel[(head_blocks, num_rows, num_splits)](
        query, kv, cache_rows, layout.ring_view(ring_cache), block_tables, rows.seq,
        rows.position, rows.start, rows.fresh, ring_starts, key_counts, rows.index, indices if indexed else rows.index, sinks, out,
        partial_out, partial_lse, query.stride(0), query.stride(1), kv.stride(0),
        out.stride(0), out.stride(1), block_tables.stride(0),
        indices.stride(0) if indexed else 0, scale,
        NUM_HEADS=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        WINDOW=layout.window, RING_ROWS=layout.ring_rows, BLOCK_SIZE=layout.block_size,
        RATE=max(layout.compress_rate, 1), PER_BLOCK=max(layout.entries_per_block, 1),
        BLOCK_ELEMS=layout.block_size * layout.row_bytes // elem,
        ENTRY_OFF=layout.entries_offset // elem, INDEXED=indexed, HEAD_BLOCK=BLOCK_H,
        TILE=BLOCK_N, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=4, num_stages=2)
    if num_splits > 1:
        merge_splits(partial_out, partial_lse, rows.index, key_counts, out, 1.0,
                     split_block_n=BLOCK_N)
    return out


@triton.jit
def _write_window_kernel(kv_ptr, ring_ptr, query_start_loc_ptr, slot_mapping_ptr, stride_kv,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, RING_ROWS: tl.constexpr,
                         TOKENS: tl.constexpr):
    seq = tl.program_id(0)
    row0 = tl.load(query_start_loc_ptr + seq)
    row_end = tl.load(query_start_loc_ptr + seq + 1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    # Only the step's latest RING_ROWS keys (an earlier one's row is a later one's); none
    # of a CUDA graph's padding (slot -1).
    first = tl.maximum(row0, row_end - RING_ROWS)
    for t0 in range(first + tl.program_id(1) * TOKENS, row_end, tl.num_programs(1) * TOKENS):
        token = t0 + tl.arange(0, TOKENS)
        keep = token < row_end
        slot = tl.load(slot_mapping_ptr + token, mask=keep, other=-1)
        keep = keep & (slot >= 0)
        dst = ring_ptr + slot * D
        src = kv_ptr + token.to(tl.int64) * stride_kv
        mask = keep[:, None] & mask_d[None, :]
        tl.store(dst[:, None] + offs_d[None, :],
                 tl.load(src[:, None] + offs_d[None, :], mask=mask), mask=mask)


def write_window_triton(layout: CompressedCacheLayout, kv: torch.Tensor,
                        ring_cache: torch.Tensor, meta, num_seqs: int,  # noqa: ANN001
                        max_query_len: int) -> None:
    """Keep the step's keys [T, D] in their sequences' rings at their slots
    (reference.write_window), but for a slot -1 (padding)."""
    if num_seqs == 0:
        return
    tokens = 8
    programs = max(1, min(triton.cdiv(min(max_query_len, layout.ring_rows), tokens), 64))
    _write_window_kernel[(num_seqs, programs)](
        kv, layout.ring_view(ring_cache), meta.query_start_loc, meta.slot_mapping,
        kv.stride(0), D=layout.head_dim, BLOCK_D=triton.next_power_of_2(layout.head_dim),
        RING_ROWS=layout.ring_rows, TOKENS=tokens, num_warps=4)
