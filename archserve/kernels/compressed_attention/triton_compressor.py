"""Triton compressor of DeepSeek V4's compressed layers (the reference: reference.py's
``_Compressor``), over the cache blocks of layout.py, in two launches per layer and step:

- emit, one program per (sequence, group the step touches): a group the step completes
  becomes its entry: the running max, sum of exponentials and weighted sum (online softmax,
  per channel) of its tokens' projections under their gates plus the position bias, picked
  up from the block's open accumulators where an earlier step began the group, and, where
  windows overlap (CSA), merged with the first series of the group before (from this
  step's tokens, or the block's closed accumulator); then normalised (the compressor's
  RMSNorm), rounded to the model dtype, rotated at the group's first position (interleaved
  pairs of the trailing rope channels) and written. The indexer's compressor shares the
  groups: its channels are accumulated beside the main ones and emitted as index keys;
- carry, one program per sequence: what the next steps need of this one, written after
  every emit has read the accumulators: for an overlapping layer, the first series of the
  latest group each block closes in this step (the next group mixes it in, whichever step
  or sequence computes that group); the open group's accumulators where the step ends
  inside a group.

Only the accumulators of groups a step touches are read, and only those it leaves are
written, so blocks another sequence shares through the prefix cache (full, every group
closed) are read, never written. A sequence whose slots are -1 (a CUDA graph's padding)
writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.compressed_attention.interface import CompressedLayerParams
from archserve.kernels.compressed_attention.layout import (
    CLOSED_NEXT,
    OPEN_NEXT,
    OPEN_OWN,
    CompressedCacheLayout,
)
from archserve.kernels.elementwise.triton_norm_rope import rope_tail_interleaved

# Tokens a program folds in at once.
TOKEN_TILE = 8
# The accumulator slots, as the kernels read them (layout.py).
_OPEN_NEXT = tl.constexpr(OPEN_NEXT)
_CLOSED_NEXT = tl.constexpr(CLOSED_NEXT)


@triton.jit
def _fold(mx, total, weighted, kv_ptr, gate_ptr, bias_ptr, stride_t, bias_stride, row0,
          first_pos, lo, hi, col0, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
          RATE: tl.constexpr, TOK: tl.constexpr):
    """Fold the tokens at positions [lo, hi) (rows row0 + position - first_pos of the step's
    projections, columns col0 .. col0 + WIDTH) into an accumulator (online softmax)."""
    cols = tl.arange(0, BLOCK_W)
    cmask = cols < WIDTH
    for t0 in range(lo, hi, TOK):
        pos = t0 + tl.arange(0, TOK)
        valid = pos < hi
        rows = (row0 + pos - first_pos).to(tl.int64)
        mask = valid[:, None] & cmask[None, :]
        v = tl.load(kv_ptr + rows[:, None] * stride_t + col0 + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        z = tl.load(gate_ptr + rows[:, None] * stride_t + col0 + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        z += tl.load(bias_ptr + (pos % RATE)[:, None] * bias_stride + col0 + cols[None, :],
                     mask=mask, other=0.0)
        z = tl.where(mask, z, float("-inf"))
        new_mx = tl.maximum(mx, tl.max(z, axis=0))
        safe = tl.where(new_mx == float("-inf"), 0.0, new_mx)
        alpha = tl.exp(mx - safe)
        w = tl.exp(z - safe[None, :])
        total = total * alpha + tl.sum(w, axis=0)
        weighted = weighted * alpha + tl.sum(w * v, axis=0)
        mx = new_mx
    return mx, total, weighted


@triton.jit
def _merge(mx, total, weighted, mx2, total2, weighted2):
    new_mx = tl.maximum(mx, mx2)
    safe = tl.where(new_mx == float("-inf"), 0.0, new_mx)
    a1 = tl.exp(mx - safe)
    a2 = tl.exp(mx2 - safe)
    return new_mx, total * a1 + total2 * a2, weighted * a1 + weighted2 * a2


@triton.jit
def _state_ptr(state_ptr, block, slot, part, ch0, BLOCK_F32: tl.constexpr,
               STATE_OFF: tl.constexpr, CHANNELS: tl.constexpr):
    return (state_ptr + block.to(tl.int64) * BLOCK_F32 + STATE_OFF
            + (slot * 3 + part) * CHANNELS + ch0)


@triton.jit
def _load_acc(state_ptr, block, slot, ch0, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
              BLOCK_F32: tl.constexpr, STATE_OFF: tl.constexpr, CHANNELS: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    cmask = cols < WIDTH
    base = _state_ptr(state_ptr, block, slot, 0, ch0, BLOCK_F32, STATE_OFF, CHANNELS)
    mx = tl.load(base + cols, mask=cmask, other=float("-inf"))
    total = tl.load(base + CHANNELS + cols, mask=cmask, other=0.0)
    weighted = tl.load(base + 2 * CHANNELS + cols, mask=cmask, other=0.0)
    return mx, total, weighted


@triton.jit
def _store_acc(state_ptr, block, slot, ch0, mx, total, weighted, WIDTH: tl.constexpr,
               BLOCK_W: tl.constexpr, BLOCK_F32: tl.constexpr, STATE_OFF: tl.constexpr,
               CHANNELS: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    cmask = cols < WIDTH
    base = _state_ptr(state_ptr, block, slot, 0, ch0, BLOCK_F32, STATE_OFF, CHANNELS)
    tl.store(base + cols, mx, mask=cmask)
    tl.store(base + CHANNELS + cols, total, mask=cmask)
    tl.store(base + 2 * CHANNELS + cols, weighted, mask=cmask)


@triton.jit
def _series(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, group, step_start, end, row0,
            slot, series, stride_t, bias_stride,
            WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, CH0: tl.constexpr,
            RATE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_F32: tl.constexpr,
            STATE_OFF: tl.constexpr, CHANNELS: tl.constexpr, TOK: tl.constexpr):
    """One series of ``group`` (columns series * WIDTH ..) over what exists of it up to
    ``end``: the block's open accumulator ``slot`` where the group began before
    ``step_start``, merged with the step's tokens of it."""
    mx = tl.full([BLOCK_W], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_W], tl.float32)
    weighted = tl.zeros([BLOCK_W], tl.float32)
    g_lo = group * RATE
    lo = tl.maximum(g_lo, step_start)
    hi = tl.minimum(g_lo + RATE, end)
    mx, total, weighted = _fold(mx, total, weighted, kv_ptr, gate_ptr, bias_ptr, stride_t,
                                bias_stride, row0, step_start, lo, hi, series * WIDTH,
                                WIDTH, BLOCK_W, RATE, TOK)
    if g_lo < step_start:
        block = tl.load(table_row + g_lo // BLOCK_SIZE)
        mx2, total2, weighted2 = _load_acc(state_ptr, block, slot, CH0, WIDTH, BLOCK_W,
                                           BLOCK_F32, STATE_OFF, CHANNELS)
        mx, total, weighted = _merge(mx, total, weighted, mx2, total2, weighted2)
    return mx, total, weighted


@triton.jit
def _emit_part(out_ptr, weight_ptr, inv_freq_ptr, total, weighted, position, eps,
               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, ROPE: tl.constexpr):
    """RMSNorm of the accumulated value, rounded to the output's dtype, its trailing ROPE
    channels rotated (interleaved pairs) at ``position``, stored at ``out_ptr``."""
    cols = tl.arange(0, BLOCK_W)
    cmask = cols < WIDTH
    value = tl.where(cmask, weighted / tl.where(cmask, total, 1.0), 0.0)
    rms = tl.rsqrt(tl.sum(value * value, axis=0) / WIDTH + eps)
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = (w * value * rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = rope_tail_interleaved(y, inv_freq_ptr, position, WIDTH, BLOCK_W, ROPE, False)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _emit_group(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, group, start, end, row0,
                stride_t, bias_stride, out_ptr, norm_ptr, inv_freq_ptr, eps,
                WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, CH0: tl.constexpr,
                ROPE: tl.constexpr, RATE: tl.constexpr, OVERLAP: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_F32: tl.constexpr, STATE_OFF: tl.constexpr,
                CHANNELS: tl.constexpr, TOK: tl.constexpr, OWN: tl.constexpr):
    """One part's (the latent's or the index keys' channels, CH0 ..) entry of ``group``, a
    group the step completes: its own series, where windows overlap merged with the first
    series of the group before, emitted at ``out_ptr``."""
    OWN_SERIES: tl.constexpr = 1 if OVERLAP else 0
    own = _series(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, group, start, end, row0,
                  OWN, OWN_SERIES, stride_t, bias_stride, WIDTH, BLOCK_W, CH0, RATE,
                  BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK)
    if OVERLAP:
        if group > 0:
            prev = group - 1
            if group * RATE <= start:     # closed in an earlier step: its block kept it
                pblock = tl.load(table_row + prev * RATE // BLOCK_SIZE)
                mx, total, weighted = _load_acc(state_ptr, pblock, _CLOSED_NEXT, CH0, WIDTH,
                                                BLOCK_W, BLOCK_F32, STATE_OFF, CHANNELS)
            else:
                mx, total, weighted = _series(
                    kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, prev, start, end, row0,
                    _OPEN_NEXT, 0, stride_t, bias_stride, WIDTH, BLOCK_W, CH0, RATE,
                    BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK)
            own = _merge(own[0], own[1], own[2], mx, total, weighted)
    _emit_part(out_ptr, norm_ptr, inv_freq_ptr, own[1], own[2], group * RATE, eps, WIDTH,
               BLOCK_W, ROPE)


@triton.jit
def _carry(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, g_first, g_last, start, end,
           row0, stride_t, bias_stride, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
           CH0: tl.constexpr, RATE: tl.constexpr, OVERLAP: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, BLOCK_F32: tl.constexpr, STATE_OFF: tl.constexpr,
           CHANNELS: tl.constexpr, TOK: tl.constexpr, OWN: tl.constexpr):
    """What the next steps need of one part's (CH0 ..) accumulators: for an overlapping
    layer, the first series of each block's latest group this step closes; the open group's
    series where the step ends inside a group."""
    OWN_SERIES: tl.constexpr = 1 if OVERLAP else 0
    if OVERLAP:
        # Each block's latest group this step closes keeps its first series.
        g_closed = tl.where((g_last + 1) * RATE <= end, g_last, g_last - 1)
        for group in range(g_first, g_closed + 1):
            closes_block = ((group + 1) * RATE) % BLOCK_SIZE == 0
            if closes_block or group == g_closed:
                block = tl.load(table_row + group * RATE // BLOCK_SIZE)
                mx, total, weighted = _series(
                    kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, group, start, end, row0,
                    _OPEN_NEXT, 0, stride_t, bias_stride, WIDTH, BLOCK_W, CH0, RATE,
                    BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK)
                _store_acc(state_ptr, block, _CLOSED_NEXT, CH0, mx, total, weighted, WIDTH,
                           BLOCK_W, BLOCK_F32, STATE_OFF, CHANNELS)
    if (g_last + 1) * RATE > end:        # the step ends inside a group: keep it open
        block = tl.load(table_row + g_last * RATE // BLOCK_SIZE)
        own = _series(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, g_last, start, end,
                      row0, OWN, OWN_SERIES, stride_t, bias_stride, WIDTH, BLOCK_W, CH0, RATE,
                      BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK)
        if OVERLAP:
            nxt = _series(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, g_last, start, end,
                          row0, _OPEN_NEXT, 0, stride_t, bias_stride, WIDTH, BLOCK_W, CH0,
                          RATE, BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK)
        # The reads above (this program's threads) come before the stores below.
        tl.debug_barrier()
        _store_acc(state_ptr, block, OWN, CH0, own[0], own[1], own[2], WIDTH, BLOCK_W,
                   BLOCK_F32, STATE_OFF, CHANNELS)
        if OVERLAP:
            _store_acc(state_ptr, block, _OPEN_NEXT, CH0, nxt[0], nxt[1], nxt[2], WIDTH,
                       BLOCK_W, BLOCK_F32, STATE_OFF, CHANNELS)


@triton.jit
def _compressor_kernel(kv_ptr, gate_ptr, bias_ptr, ikv_ptr, igate_ptr, ibias_ptr,
                       norm_ptr, inorm_ptr, inv_freq_ptr, rows_ptr, state_ptr,
                       block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, slot_mapping_ptr,
                       stride_kv, stride_ikv, stride_bias, stride_ibias, stride_block_table,
                       eps,
                       D: tl.constexpr, DI: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DI: tl.constexpr, ROPE: tl.constexpr, RATE: tl.constexpr,
                       OVERLAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       PER_BLOCK: tl.constexpr, BLOCK_ELEMS: tl.constexpr,
                       ENTRY_OFF: tl.constexpr, INDEX_OFF: tl.constexpr,
                       BLOCK_F32: tl.constexpr, STATE_OFF: tl.constexpr,
                       TOK: tl.constexpr, OWN: tl.constexpr, EMIT: tl.constexpr):
    # OWN: the slot of the open group's own series (its second where windows overlap). The
    # latent's channels (0 .. D) and the index keys' (D .. D + DI) are two parts of the same
    # groups, each accumulated, carried and emitted on its own.
    seq = tl.program_id(0)
    row0 = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - row0
    end = tl.load(seq_lens_ptr + seq)
    start = end - query_len
    if query_len <= 0:
        return
    # A CUDA graph's padding sequence (its slots -1) writes nothing.
    if tl.load(slot_mapping_ptr + row0 + query_len - 1) < 0:
        return
    CHANNELS: tl.constexpr = D + DI
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    g_first = start // RATE
    g_last = (end - 1) // RATE
    if EMIT:
        group = g_first + tl.program_id(1)
        if group > g_last or (group + 1) * RATE > end:
            return
        block = tl.load(table_row + group * RATE // BLOCK_SIZE).to(tl.int64)
        slot = group % PER_BLOCK
        block_rows = rows_ptr + block * BLOCK_ELEMS
        _emit_group(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, group, start, end, row0,
                    stride_kv, stride_bias, block_rows + ENTRY_OFF + slot * D, norm_ptr,
                    inv_freq_ptr, eps, D, BLOCK_D, 0, ROPE, RATE, OVERLAP, BLOCK_SIZE,
                    BLOCK_F32, STATE_OFF, CHANNELS, TOK, OWN)
        if DI > 0:
            _emit_group(ikv_ptr, igate_ptr, ibias_ptr, state_ptr, table_row, group, start, end,
                        row0, stride_ikv, stride_ibias, block_rows + INDEX_OFF + slot * DI,
                        inorm_ptr, inv_freq_ptr, eps, DI, BLOCK_DI, D, ROPE, RATE, OVERLAP,
                        BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK, OWN)
    else:
        _carry(kv_ptr, gate_ptr, bias_ptr, state_ptr, table_row, g_first, g_last, start, end,
               row0, stride_kv, stride_bias, D, BLOCK_D, 0, RATE, OVERLAP, BLOCK_SIZE,
               BLOCK_F32, STATE_OFF, CHANNELS, TOK, OWN)
        if DI > 0:
            _carry(ikv_ptr, igate_ptr, ibias_ptr, state_ptr, table_row, g_first, g_last, start,
                   end, row0, stride_ikv, stride_ibias, DI, BLOCK_DI, D, RATE, OVERLAP,
                   BLOCK_SIZE, BLOCK_F32, STATE_OFF, CHANNELS, TOK, OWN)


def groups_per_step(max_query_len: int, rate: int) -> int:
    """The most groups a sequence's step of ``max_query_len`` tokens touches."""
    return (max(max_query_len, 1) + rate - 2) // rate + 1


def compress_triton(layout: CompressedCacheLayout, layer: CompressedLayerParams,
                    kv: torch.Tensor, gate: torch.Tensor, index_kv: torch.Tensor | None,
                    index_gate: torch.Tensor | None, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, max_query_len: int | None = None) -> None:
    """The emit and carry launches of one compressed layer's step (``max_query_len``: the
    grid's bound, a host int; None: the step's)."""
    c = layer.compressor
    di = layout.index_dim
    elem = layout.elem
    rows = layout.block_span(kv_cache).view(layout.dtype)
    state = layout.block_span(kv_cache).view(torch.float32)
    block_bytes = layout.block_size * layout.row_bytes
    has_index = di > 0
    groups = groups_per_step(meta.max_query_len if max_query_len is None else max_query_len,
                             c.rate)
    args = (kv, gate, c.position_bias, index_kv if has_index else kv,
            index_gate if has_index else gate,
            c.index_position_bias if has_index else c.position_bias, c.norm_weight,
            c.index_norm_weight if has_index else c.norm_weight, layer.inv_freq, rows, state,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.slot_mapping,
            kv.stride(0),
            index_kv.stride(0) if has_index else kv.stride(0), c.position_bias.stride(0),
            c.index_position_bias.stride(0) if has_index else 0, meta.block_tables.stride(0),
            layer.eps)
    constants = dict(D=layout.head_dim, DI=di, BLOCK_D=triton.next_power_of_2(layout.head_dim),
                     BLOCK_DI=triton.next_power_of_2(max(di, 2)), ROPE=layer.rope_dim,
                     RATE=c.rate, OVERLAP=layout.overlap, BLOCK_SIZE=layout.block_size,
                     PER_BLOCK=layout.entries_per_block, BLOCK_ELEMS=block_bytes // elem,
                     ENTRY_OFF=layout.entries_offset // elem,
                     INDEX_OFF=layout.index_offset // elem, BLOCK_F32=block_bytes // 4,
                     STATE_OFF=layout.state_offset // 4, TOK=TOKEN_TILE,
                     OWN=OPEN_OWN if layout.overlap else 0)
    num_seqs = meta.num_seqs
    if num_seqs == 0:
        return
    _compressor_kernel[(num_seqs, groups)](*args, EMIT=True, **constants, num_warps=4)
    _compressor_kernel[(num_seqs,)](*args, EMIT=False, **constants, num_warps=4)
