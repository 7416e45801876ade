"""Triton lightning-indexer scores: each query row against every cached key it sees.

score(row, s) = sum_h w[row, h] * relu(q[row, h] . k[s]) for the row's keys s < length, into
a row of an fp32 buffer (entries past the row's length are left unwritten; the top-k reads
no further). A program takes BLOCK_Q rows of one sequence and stacks their heads as the M
side of one ``tl.dot`` against a tile of BLOCK_N keys, so a prompt's rows share each key
tile; a decode row (BLOCK_Q 1) makes its heads the M side. The programs of a row block
stride over its key tiles (grid axis 1, ``splits`` of them, from host ints only: a CUDA
graph replays the launch for any lengths; a runtime argument, and the score rows' stride a
multiple of 16, so one compiled variant serves every step, however many row blocks and keys
it has). A block whose rows all see no more than ``topk`` keys does nothing: those rows
attend to every key.

The keys are read through the block table from the cache rows of layout.py: the model
dtype, or e4m3 with a power-of-two scale per 128 values (dequantized exactly in 16 bits).
The queries and the keys meet in the model dtype with fp32 accumulation; transformers
multiplies the same 16-bit values in fp32, where their products are exact, so the scores
differ by the sums' order only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_cache_write import paged_token_offsets
from archserve.kernels.sparse_mla.layout import SparseMlaLayout
from archserve.kernels.sparse_mla.triton_rows import TORCH_TO_TL, load_index_keys
from archserve.kernels.triton_dot import dot_precision

INDEX_BLOCK_N = 64
# Rows x heads one program stacks (the dot's M): a prompt block of 128 / heads rows.
INDEX_BLOCK_M = 128
# Programs a launch aims at per SM, counting each row's split programs.
INDEX_PROGRAMS_PER_SM = 4


@dataclass
class RowBlocks:
    """A step's query rows cut into blocks of at most ``rows_per_block`` rows of one
    sequence: block b covers rows [start[b], end[b])."""

    start: torch.Tensor
    end: torch.Tensor
    rows_per_block: int


def row_blocks(query_lens: list[int], rows_per_block: int, device: torch.device) -> RowBlocks:
    """Blocks of the consecutive rows of each sequence (query_lens: rows per sequence)."""
    starts, ends, first = [], [], 0
    for n in query_lens:
        for s in range(first, first + n, rows_per_block):
            starts.append(s)
            ends.append(min(s + rows_per_block, first + n))
        first += n
    start = torch.from_numpy(np.asarray(starts, dtype=np.int32)).to(device)
    end = torch.from_numpy(np.asarray(ends, dtype=np.int32)).to(device)
    return RowBlocks(start, end, rows_per_block)


@triton.jit(do_not_specialize=["splits"])
def _index_scores_kernel(q_ptr, w_ptr, cache_ptr, block_tables_ptr, row_seq_ptr, row_len_ptr,
                         block_start_ptr, block_end_ptr, scores_ptr,
                         stride_q_row, stride_q_head, stride_w_row, stride_cache_block,
                         stride_cache_token, stride_block_table, stride_scores, splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOPK: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, INDEX_OFFSET: tl.constexpr,
                         INDEX_SCALE_OFFSET: tl.constexpr, INDEX_FP8: tl.constexpr,
                         KEY_DTYPE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, E4M3_BITS: tl.constexpr):
    block = tl.program_id(0)
    split = tl.program_id(1)
    if BLOCK_Q == 1:        # decode: row b is block b
        first = block
        end = block + 1
    else:
        first = tl.load(block_start_ptr + block)
        end = tl.load(block_end_ptr + block)
    m = tl.arange(0, BLOCK_Q * BLOCK_H)
    rows = first + m // BLOCK_H
    heads = m % BLOCK_H
    live = (rows < end) & (heads < NUM_HEADS)
    q_rows = first + tl.arange(0, BLOCK_Q)
    lengths = tl.load(row_len_ptr + q_rows, mask=q_rows < end, other=0)
    longest = tl.max(lengths, axis=0)
    # Rows that see at most TOPK keys take them all: nothing to score.
    num_tiles = tl.where(longest > TOPK, tl.cdiv(longest, BLOCK_N), 0)
    seq = tl.load(row_seq_ptr + first)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q_row
                + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=live[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w_ptr + rows.to(tl.int64) * stride_w_row + heads, mask=live, other=0.0)
    if DOT_PRECISION == "ieee":
        q = q.to(tl.float32)
    out_rows = scores_ptr + q_rows.to(tl.int64)[:, None] * stride_scores
    for tile in range(split, num_tiles, splits):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        seen = pos < longest
        offsets = paged_token_offsets(block_table_row, pos, seen, stride_cache_block,
                                      stride_cache_token, BLOCK_SIZE)
        keys = load_index_keys(cache_ptr, offsets, seen, offs_d, mask_d, INDEX_OFFSET,
                               INDEX_SCALE_OFFSET, HEAD_DIM, INDEX_FP8, KEY_DTYPE, E4M3_BITS)
        products = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=DOT_PRECISION)
        weighted = tl.maximum(products, 0.0) * w[:, None]
        scores = tl.sum(tl.reshape(weighted, [BLOCK_Q, BLOCK_H, BLOCK_N]), axis=1)
        tl.store(out_rows + pos[None, :], scores,
                 mask=(pos[None, :] < lengths[:, None]) & (q_rows < end)[:, None])


@dataclass
class IndexKeySource:
    """Where a launch reads the indexer keys: ``cache`` as bytes, key ``r`` of a sequence in
    block ``block_tables[seq, r // rows_per_block]`` at byte ``block * block_stride +
    (r % rows_per_block) * row_stride + offset`` (fp8: its scales from ``scale_offset``)."""

    cache: torch.Tensor
    block_stride: int
    row_stride: int
    rows_per_block: int
    offset: int
    scale_offset: int = 0
    fp8: bool = False

    @classmethod
    def of_sparse_mla(cls, layout: SparseMlaLayout, kv_cache: torch.Tensor) -> IndexKeySource:
        """A sparse-MLA cache: one key a token, in each token's row."""
        rows = layout.byte_rows(kv_cache)
        block_size = kv_cache.shape[2]
        return cls(rows, block_size * rows.stride(0), rows.stride(0), block_size,
                   layout.index_offset, layout.index_scale_offset, layout.index_fp8)


def index_scores_triton(layout: SparseMlaLayout, kv_cache: torch.Tensor,
                        block_tables: torch.Tensor, query: torch.Tensor,
                        weights: torch.Tensor, row_seq: torch.Tensor,
                        row_lengths: torch.Tensor, max_length: int, topk: int,
                        blocks: RowBlocks | None = None, num_sms: int = 0,
                        e4m3_bits: bool = False) -> torch.Tensor:
    """fp32 scores [R, max_length] of query rows [R, H, D] (weights [R, H] fp32, every scale
    in them) over their sequences' cached indexer keys: row r reads block-table row
    ``row_seq[r]`` and sees its first ``row_lengths[r]`` keys. ``blocks`` groups rows of
    one sequence (prompts); None: one row a program (decode). ``max_length``, a host int
    (the step's longest context, or a graph's max_model_len), sizes the buffer and the
    grid."""
    return launch_index_scores(IndexKeySource.of_sparse_mla(layout, kv_cache), block_tables,
                               query, weights, row_seq, row_lengths, max_length, topk, blocks,
                               num_sms, e4m3_bits)


def launch_index_scores(keys: IndexKeySource, block_tables: torch.Tensor, query: torch.Tensor,
                        weights: torch.Tensor, row_seq: torch.Tensor,
                        row_lengths: torch.Tensor, max_length: int, topk: int,
                        blocks: RowBlocks | None = None, num_sms: int = 0,
                        e4m3_bits: bool = False) -> torch.Tensor:
    """``index_scores_triton`` over keys wherever ``keys`` says (DeepSeek V4's compressed
    entries keep theirs a block's worth together)."""
    num_rows, num_heads, head_dim = query.shape
    scores = score_rows(num_rows, max_length, query.device)
    if num_rows == 0 or max_length <= topk:
        return scores
    rows_per_block = blocks.rows_per_block if blocks is not None else 1
    num_blocks = blocks.start.shape[0] if blocks is not None else num_rows
    block_h = max(triton.next_power_of_2(num_heads), 16 // rows_per_block)
    tiles = triton.cdiv(max_length, INDEX_BLOCK_N)
    splits = max(1, min(tiles, triton.cdiv(INDEX_PROGRAMS_PER_SM * max(num_sms, 1),
                                           num_blocks)))
    start = blocks.start if blocks is not None else row_lengths
    end = blocks.end if blocks is not None else row_lengths
    _index_scores_kernel[(num_blocks, splits)](
        query, weights, keys.cache, block_tables, row_seq, row_lengths, start, end, scores,
        query.stride(0), query.stride(1), weights.stride(0), keys.block_stride,
        keys.row_stride, block_tables.stride(0), scores.stride(0), splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, TOPK=topk, BLOCK_SIZE=keys.rows_per_block,
        INDEX_OFFSET=keys.offset, INDEX_SCALE_OFFSET=keys.scale_offset,
        INDEX_FP8=keys.fp8, KEY_DTYPE=TORCH_TO_TL[query.dtype],
        BLOCK_Q=rows_per_block, BLOCK_H=block_h,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16), BLOCK_N=INDEX_BLOCK_N,
        DOT_PRECISION=dot_precision(query.dtype), E4M3_BITS=e4m3_bits,
        num_warps=4)
    return scores


# Score rows start SCORE_ROW_ALIGN values apart: Triton compiles a variant of a kernel per
# integer argument's divisibility by 16, and a row stride of the step's longest context
# (any number) made the scores and top-k kernels compile anew mid-request.
SCORE_ROW_ALIGN = 16


def score_rows(num_rows: int, max_length: int, device: torch.device) -> torch.Tensor:
    """An fp32 [num_rows, max_length] buffer (one column at least) whose row stride is a
    multiple of SCORE_ROW_ALIGN."""
    width = max(max_length, 1)
    stride = triton.cdiv(width, SCORE_ROW_ALIGN) * SCORE_ROW_ALIGN
    return torch.empty(num_rows, stride, dtype=torch.float32, device=device)[:, :width]


# The score buffer holds fp32 rows of the longest context; rows are scored and selected in
# groups of at most this much of it.
SCORES_BUDGET_BYTES = 64 << 20


def row_groups(num_rows: int, max_length: int) -> list[tuple[int, int]]:
    """[start, end) groups of at most SCORES_BUDGET_BYTES of fp32 score rows."""
    per_group = max(1, SCORES_BUDGET_BYTES // (4 * max(max_length, 1)))
    return [(s, min(s + per_group, num_rows)) for s in range(0, num_rows, per_group)]


def select_top_keys(keys: IndexKeySource, block_tables: torch.Tensor, query: torch.Tensor,
                    weights: torch.Tensor, row_seq: torch.Tensor, row_lengths: torch.Tensor,
                    max_length: int, topk: int, query_lens: list[int] | None, num_sms: int = 0,
                    e4m3_bits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's ``topk`` best keys by the indexer (the scores, then the per-row
    select, triton_topk.py): (int32 [R, topk] key numbers, -1 padded; int32 [R] how many).
    ``query_lens``: the rows per sequence of a prompt step (rows of one sequence share key
    tiles); None: a decode step, a row a sequence."""
    from archserve.kernels.sparse_mla.triton_topk import select_topk_triton
    num_rows = row_seq.shape[0]
    device = row_seq.device
    indices = torch.empty(num_rows, topk, dtype=torch.int32, device=device)
    counts = torch.empty(num_rows, dtype=torch.int32, device=device)
    num_heads = query.shape[1]
    for start, end in row_groups(num_rows, max_length):
        blocks = None if query_lens is None else row_blocks(
            _group_query_lens(query_lens, start, end), prompt_rows_per_block(num_heads), device)
        scores = launch_index_scores(keys, block_tables, query[start:end], weights[start:end],
                                     row_seq[start:end], row_lengths[start:end], max_length,
                                     topk, blocks, num_sms, e4m3_bits)
        select_topk_triton(scores, row_lengths[start:end], topk, indices[start:end],
                           counts[start:end], num_sms)
    return indices, counts


def _group_query_lens(query_lens: list[int], start: int, end: int) -> list[int]:
    """The rows per sequence of rows [start, end) of a step (sequences cut at its edges)."""
    out, first = [], 0
    for n in query_lens:
        lo, hi = max(first, start), min(first + n, end)
        if hi > lo:
            out.append(hi - lo)
        first += n
    return out


def prompt_rows_per_block(num_heads: int) -> int:
    """Rows a prompt block stacks: INDEX_BLOCK_M of rows x heads (one row at least)."""
    return max(1, INDEX_BLOCK_M // triton.next_power_of_2(num_heads))
