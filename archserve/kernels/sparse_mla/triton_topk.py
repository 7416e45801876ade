"""Triton per-row top-k of the indexer's scores: a radix select, one program per query row.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Scores a program reads at once (a pass streams its row through BLOCK-wide chunks): wide,
# so that a batch-1 row of 128k scores takes 32 chunks a pass, each one histogram and one
# barrier (16 values a thread at 8 warps).
TOPK_BLOCK = 4096


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
def _topk_kernel(scores_ptr, row_len_ptr, out_ptr, count_ptr, stride_scores, stride_out,
                 TOPK: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.load(row_len_ptr + row)
    src = scores_ptr + row * stride_scores
    dst = out_ptr + row * stride_out
    tl.store(count_ptr + row, tl.minimum(length, TOPK))
    if length <= TOPK:      # every key: dense attention
        for start in range(0, TOPK, OUT_BLOCK):
            pos = start + tl.arange(0, OUT_BLOCK)
            tl.store(dst + pos, tl.where(pos < length, pos, -1), mask=pos < TOPK)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.zeros([1], tl.int64)      # the chosen bytes of the k-th best key
        remaining = tl.zeros([1], tl.int32) + TOPK   # how many to take at or below it
        for shift in tl.static_range(24, -1, -8):
            hist = tl.zeros([256], tl.int32)
            excluded = tl.zeros([1], tl.int32)
            for start in range(0, length, BLOCK):
                pos, valid, key = _chunk_keys(src, start, length, BLOCK)
                match = valid & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                byte = ((key >> shift) & 0xFF).to(tl.int32)
                # Every lane lands in a bin: the ones not matching go to bin 0, taken out below.
                hist += tl.histogram(tl.where(match, byte, 0), 256)
                excluded += BLOCK - tl.sum(match.to(tl.int32), axis=0)
            hist = tl.where(bins == 0, hist - excluded, hist)
            at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            digit = tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1
            remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix = prefix | (digit.to(tl.int64) << shift)
        first_equal = TOPK - remaining
        taken_above = tl.zeros([1], tl.int32)
        taken_equal = tl.zeros([1], tl.int32)
        for start in range(0, length, BLOCK):
            pos, valid, key = _chunk_keys(src, start, length, BLOCK)
            above = (valid & (key > prefix)).to(tl.int32)
            equal = (valid & (key == prefix)).to(tl.int32)
            above_rank = taken_above + tl.cumsum(above, axis=0) - 1
            equal_rank = taken_equal + tl.cumsum(equal, axis=0) - 1
            tl.store(dst + above_rank, pos, mask=above > 0)
            tl.store(dst + first_equal + equal_rank, pos,
                     mask=(equal > 0) & (equal_rank < remaining))
            taken_above += tl.sum(above, axis=0)
            taken_equal += tl.sum(equal, axis=0)


def select_topk_triton(scores: torch.Tensor, row_lengths: torch.Tensor, topk: int,
                       out: torch.Tensor | None = None, counts: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, >= max length] fp32, row_lengths [R] int32 -> (int32 [R, topk] positions,
    -1 padded; int32 [R] how many are valid, min(length, topk))."""
    num_rows = row_lengths.shape[0]
    if out is None:
        out = torch.empty(num_rows, topk, dtype=torch.int32, device=row_lengths.device)
    if counts is None:
        counts = torch.empty(num_rows, dtype=torch.int32, device=row_lengths.device)
    if num_rows:
        _topk_kernel[(num_rows,)](
            scores, row_lengths, out, counts, scores.stride(0), out.stride(0),
            TOPK=topk, BLOCK=TOPK_BLOCK, OUT_BLOCK=min(triton.next_power_of_2(topk), 1024),
            num_warps=8)
    return out, counts
