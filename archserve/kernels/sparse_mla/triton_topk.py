"""Triton per-row top-k of the indexer's scores: a radix select, one program per query row,
or a row split over many programs when there are few rows.

A row of ``length`` fp32 scores keeps its ``topk`` best as token positions (the first
``topk`` entries of its output row, then -1). A row with no more than ``topk`` keys keeps
every key (0 .. length - 1): attention over it is dense MLA, and its scores were never
computed (triton_indexer.py skips such rows).

The select: each score maps to a 32-bit key whose unsigned order is the float order. Four
passes over the row histogram one byte of the keys (256 bins, most significant first)
among the scores that share the bytes chosen so far, and choose the byte whose bin holds
the k-th best; after them the k-th best key is known exactly. A last pass writes every
position above it and, in position order, as many of those equal to it as are missing.
The order within a row's output is the scan's, not the scores' (attention does not care).

A decode step has a row per sequence: at batch 1 one program, on one SM, would stream a
128k-score row five times while the rest of the GPU waits. With few rows (``topk_splits``:
up to about four programs an SM in all), each row is cut into ``splits`` slices, one program
each, in five launches: each of the four passes histograms its slice and the last program of
the row to arrive (triton_argmax.count_arrival) sums the slices' histograms, chooses the
byte and keeps, per slice, how many of its scores are already known to be above the k-th
best; the write pass then puts each slice's positions after those of the slices before it.
The output is the one-program select's, position for position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_argmax import (
    ARRIVAL_COUNTERS,
    arrival_counters,
    count_arrival,
    last_arrival_verified,
    reset_arrivals,
)

# Scores a program reads at once (a pass streams its row through BLOCK-wide chunks): wide,
# so that a batch-1 row of 128k scores takes 32 chunks a pass, each one histogram and one
# barrier (16 values a thread at 8 warps).
TOPK_BLOCK = 4096
# A split row: slices of at least SPLIT_MIN_SCORES (one chunk of SPLIT_BLOCK a pass), at
# most MAX_SPLITS (the last program sums that many histograms), about SPLIT_PROGRAMS_PER_SM
# programs an SM over the step's rows. Chosen by timing the select alone on an H100 (top-2048,
# CUDA-graph replays): a 128k row took 530 us in one program, 42 us in 32 slices of 4096,
# 34 us in 64 of 2048 (128 of 1024: 77 us, the last program's sum grown); 8k and 32k rows
# were fastest at 1024 scores a slice (22 and 25 us; one program 34 and 127 us).
SPLIT_BLOCK = 1024
SPLIT_MIN_SCORES = 1024
MAX_SPLITS = 64
SPLIT_PROGRAMS_PER_SM = 4


@triton.jit
def _chunk_keys(src, start, length, BLOCK: tl.constexpr):
    """(positions, valid, keys) of a row's scores [start, start + BLOCK): each score as an
    int64 in [0, 2**32) ordered as the floats are (-0.0 just below +0.0)."""
    pos = start + tl.arange(0, BLOCK)
    valid = pos < length
    bits = tl.load(src + pos, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)          # signed order = float order
    return pos, valid, key.to(tl.int64) + 2147483648


@triton.jit
def _byte_histogram(src, lo, hi, prefix, shift, BLOCK: tl.constexpr):
    """Histogram (256 bins) of byte ``shift`` of the keys of scores [lo, hi) whose higher
    bytes are ``prefix``'s."""
    hist = tl.zeros([256], tl.int32)
    excluded = tl.zeros([1], tl.int32)
    for start in range(lo, hi, BLOCK):
        pos, valid, key = _chunk_keys(src, start, hi, BLOCK)
        match = valid & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        byte = ((key >> shift) & 0xFF).to(tl.int32)
        # Every lane lands in a bin: the ones not matching go to bin 0, taken out below.
        hist += tl.histogram(tl.where(match, byte, 0), 256)
        excluded += BLOCK - tl.sum(match.to(tl.int32), axis=0)
    return tl.where(tl.arange(0, 256) == 0, hist - excluded, hist)


@triton.jit
def _write_positions(src, dst, lo, hi, kth, first_equal, remaining, taken_above, taken_equal,
                     BLOCK: tl.constexpr):
    """Positions in [lo, hi) whose key is above ``kth`` from ``dst[taken_above]`` on, and
    those equal to it from ``dst[first_equal + taken_equal]`` on while fewer than
    ``remaining`` equal ones are written."""
    for start in range(lo, hi, BLOCK):
        pos, valid, key = _chunk_keys(src, start, hi, BLOCK)
        above = (valid & (key > kth)).to(tl.int32)
        equal = (valid & (key == kth)).to(tl.int32)
        above_rank = taken_above + tl.cumsum(above, axis=0) - 1
        equal_rank = taken_equal + tl.cumsum(equal, axis=0) - 1
        tl.store(dst + above_rank, pos, mask=above > 0)
        tl.store(dst + first_equal + equal_rank, pos,
                 mask=(equal > 0) & (equal_rank < remaining))
        taken_above += tl.sum(above, axis=0)
        taken_equal += tl.sum(equal, axis=0)


@triton.jit
def _kth_byte(hist, remaining):
    """The byte (bin of ``hist``, 256 bins) that holds the ``remaining``-th best, counting
    down from bin 255."""
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    return tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1


@triton.jit
def _write_dense(dst, length, TOPK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    """A row with no more than TOPK keys keeps every one: 0 .. length - 1, then -1."""
    for start in range(0, TOPK, OUT_BLOCK):
        pos = start + tl.arange(0, OUT_BLOCK)
        tl.store(dst + pos, tl.where(pos < length, pos, -1), mask=pos < TOPK)


@triton.jit
def _topk_kernel(scores_ptr, row_len_ptr, out_ptr, count_ptr, stride_scores, stride_out,
                 TOPK: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(row_len_ptr + row)
    src = scores_ptr + row * stride_scores
    dst = out_ptr + row * stride_out
    tl.store(count_ptr + row, tl.minimum(length, TOPK))
    if length <= TOPK:      # every key: dense attention
        _write_dense(dst, length, TOPK, OUT_BLOCK)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.zeros([1], tl.int64)      # the chosen bytes of the k-th best key
        remaining = tl.zeros([1], tl.int32) + TOPK   # how many to take at or below it
        for shift in tl.static_range(24, -1, -8):
            hist = _byte_histogram(src, 0, length, prefix, shift, BLOCK)
            digit = _kth_byte(hist, remaining)
            remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix = prefix | (digit.to(tl.int64) << shift)
        none = tl.zeros([1], tl.int32)
        _write_positions(src, dst, 0, length, prefix, TOPK - remaining, remaining, none, none,
                         BLOCK)


@triton.jit
def _slice_bounds(length, split, splits, BLOCK: tl.constexpr):
    """[lo, hi) of a row's scores that slice ``split`` of ``splits`` reads (whole chunks)."""
    per = tl.cdiv(tl.cdiv(length, splits), BLOCK) * BLOCK
    lo = split * per
    return lo, tl.minimum(lo + per, length)


# ``splits`` and ``shift`` are not specialised: the slices a row follow the step's longest
# context, and one compiled variant serves every step and pass (a new value must not stall
# a request on the compiler after start-up).
@triton.jit(do_not_specialize=["splits", "shift"])
def _split_pass_kernel(scores_ptr, row_len_ptr, out_ptr, count_ptr, hist_ptr, prefix_ptr,
                       remaining_ptr, above_ptr, equal_ptr, counters_ptr, stride_scores,
                       stride_out, splits, shift, TOPK: tl.constexpr,
                       MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr,
                       OUT_BLOCK: tl.constexpr):
    """One radix pass (byte ``shift``) of a split row: this slice's histogram; the row's
    last program chooses the byte. hist [R, splits, 256]; prefix, remaining [R];
    above, equal [R, splits]: the slices' scores above the k-th best (equal to it: the
    last pass) before each slice."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    length = tl.load(row_len_ptr + row)
    if (shift == 24) & (split == 0):
        tl.store(count_ptr + row, tl.minimum(length, TOPK))
        if length <= TOPK:
            _write_dense(out_ptr + row * stride_out, length, TOPK, OUT_BLOCK)
    if length > TOPK:
        src = scores_ptr + row * stride_scores
        if shift == 24:
            prefix = tl.zeros([1], tl.int64)
            remaining = tl.zeros([1], tl.int32) + TOPK
        else:
            prefix = tl.load(prefix_ptr + row + tl.zeros([1], tl.int32))
            remaining = tl.load(remaining_ptr + row + tl.zeros([1], tl.int32))
        lo, hi = _slice_bounds(length, split, splits, BLOCK)
        hist = _byte_histogram(src, lo, hi, prefix, shift, BLOCK)
        bins = tl.arange(0, 256)
        tl.store(hist_ptr + (row * splits + split) * 256 + bins, hist)
        if count_arrival(counters_ptr + row, splits):
            slices = tl.arange(0, MAX_SLICES)
            every = tl.load(hist_ptr + (row * splits + slices[:, None]) * 256 + bins[None, :],
                            mask=slices[:, None] < splits, other=0, cache_modifier=".cg")
            digit = _kth_byte(tl.sum(every, axis=0), remaining)
            above = tl.sum(tl.where(bins[None, :] > digit, every, 0), axis=1)
            before = tl.cumsum(above, axis=0) - above
            if shift != 24:
                before += tl.load(above_ptr + row * splits + slices, mask=slices < splits,
                                  other=0)
            tl.store(above_ptr + row * splits + slices, before, mask=slices < splits)
            if shift == 0:
                equal = tl.sum(tl.where(bins[None, :] == digit, every, 0), axis=1)
                tl.store(equal_ptr + row * splits + slices, tl.cumsum(equal, axis=0) - equal,
                         mask=slices < splits)
            tl.store(remaining_ptr + row + tl.zeros([1], tl.int32),
                     remaining - tl.sum(above, axis=0))
            tl.store(prefix_ptr + row + tl.zeros([1], tl.int32),
                     prefix | (digit.to(tl.int64) << shift))
            reset_arrivals(counters_ptr + row)


@triton.jit(do_not_specialize=["splits"])
def _split_write_kernel(scores_ptr, row_len_ptr, out_ptr, prefix_ptr, remaining_ptr,
                        above_ptr, equal_ptr, stride_scores, stride_out, splits,
                        TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """A split row's positions: each slice's above the k-th best after those of the slices
    before it, and its equal ones after the earlier slices' equal ones while they fit."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    length = tl.load(row_len_ptr + row)
    if length > TOPK:
        src = scores_ptr + row * stride_scores
        dst = out_ptr + row * stride_out
        prefix = tl.load(prefix_ptr + row)
        remaining = tl.load(remaining_ptr + row)
        lo, hi = _slice_bounds(length, split, splits, BLOCK)
        _write_positions(src, dst, lo, hi, prefix, TOPK - remaining, remaining,
                         tl.load(above_ptr + row * splits + split),
                         tl.load(equal_ptr + row * splits + split), BLOCK)


def topk_splits(num_rows: int, width: int, num_sms: int) -> int:
    """Slices a row of ``width`` scores is cut into among ``num_rows`` rows on ``num_sms``
    SMs (0: unknown, one program a row): enough programs for the GPU, never more slices
    than SPLIT_MIN_SCORES-score pieces of the row."""
    if num_sms <= 0 or num_rows > ARRIVAL_COUNTERS or not last_arrival_verified():
        return 1
    wanted = SPLIT_PROGRAMS_PER_SM * num_sms // max(num_rows, 1)
    return max(1, min(MAX_SPLITS, wanted, triton.cdiv(width, SPLIT_MIN_SCORES)))


def select_topk_triton(scores: torch.Tensor, row_lengths: torch.Tensor, topk: int,
                       out: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                       num_sms: int = 0, splits: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, >= max length] fp32, row_lengths [R] int32 -> (int32 [R, topk] positions,
    -1 padded; int32 [R] how many are valid, min(length, topk)). ``num_sms``: the GPU's,
    for ``topk_splits``; ``splits``: the slices a row, chosen by the caller instead."""
    num_rows = row_lengths.shape[0]
    device = row_lengths.device
    if out is None:
        out = torch.empty(num_rows, topk, dtype=torch.int32, device=device)
    if counts is None:
        counts = torch.empty(num_rows, dtype=torch.int32, device=device)
    if not num_rows:
        return out, counts
    if splits is None:
        splits = topk_splits(num_rows, scores.shape[1], num_sms)
    out_block = min(triton.next_power_of_2(topk), 1024)
    if splits == 1:
        _topk_kernel[(num_rows,)](
            scores, row_lengths, out, counts, scores.stride(0), out.stride(0),
            TOPK=topk, BLOCK=TOPK_BLOCK, OUT_BLOCK=out_block, num_warps=8)
        return out, counts
    if num_rows > ARRIVAL_COUNTERS or splits > MAX_SPLITS:
        raise ValueError(f"{num_rows} rows in {splits} slices: at most {ARRIVAL_COUNTERS} "
                         f"rows (a counter each) and {MAX_SPLITS} slices")
    hist = torch.empty(num_rows, splits, 256, dtype=torch.int32, device=device)
    prefix = torch.empty(num_rows, dtype=torch.int64, device=device)
    remaining = torch.empty(num_rows, dtype=torch.int32, device=device)
    above = torch.empty(num_rows, splits, dtype=torch.int32, device=device)
    equal = torch.empty(num_rows, splits, dtype=torch.int32, device=device)
    grid = (num_rows, splits)
    for shift in (24, 16, 8, 0):
        _split_pass_kernel[grid](
            scores, row_lengths, out, counts, hist, prefix, remaining, above, equal,
            arrival_counters(device), scores.stride(0), out.stride(0), splits, shift,
            TOPK=topk, MAX_SLICES=MAX_SPLITS, BLOCK=SPLIT_BLOCK, OUT_BLOCK=out_block,
            num_warps=4)
    _split_write_kernel[grid](
        scores, row_lengths, out, prefix, remaining, above, equal, scores.stride(0),
        out.stride(0), splits, TOPK=topk, BLOCK=SPLIT_BLOCK, num_warps=4)
    return out, counts
