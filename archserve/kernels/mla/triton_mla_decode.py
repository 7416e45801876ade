"""Triton paged MLA decode: absorbed queries over the latent cache, one query token per sequence.

Every query head of a sequence attends to the same latent rows (``c_kv | k_pe``, one shared
KV head), so a program owns a block of BLOCK_H heads of one sequence and makes those heads
the M dimension of its ``tl.dot``s: each latent tile is read from memory once for all of
them and serves both products, scores = q_nope . c_kv + q_pe . k_pe and out += p . c_kv.
The head blocks of one sequence are neighbours in the grid (axis 0), so where a model has
more heads than one block (DeepSeek-V3's 128), the blocks read the same tiles while they
are still in L2.

KEYS_AS_ROWS computes the same products transposed: scores as c_kv . q_nopeᵀ ([tokens,
heads]) and the output as c_kvᵀ . pᵀ ([latent, heads]). Then the heads are the dots' narrow
N side, and the wide M side is the token tile or the 512 latent values. Hopper's wgmma needs
M = 64 and takes N = 16, so it cannot run the [16 heads, ...] form (measured at 61% of copy,
77 TFLOP/s, on the H200); the transposed form gives it 64-row operands.

When sequences x head blocks cannot fill the GPU the context is split (flash-decoding: the
standard decode kernel's rule, split spans, partial outputs and merge, from triton_decode).
Grid and split count follow from host ints (the batch size, the longest possible context,
the SM count), never from device values, so the launch is captured in CUDA graphs.

An fp8 (e4m3) latent cache holds ``latent / k_scale``; both products are scaled back by
``k_scale``. GPUs without an e4m3 type read it as bytes (see triton_cache_write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_cache_write import (
    E4M3_BITS_SCALE,
    cache_operand,
    paged_token_offsets,
)
from archserve.kernels.attention.triton_decode import (
    choose_num_splits,
    decode_split_range,
    merge_splits,
    online_softmax_start,
    online_softmax_step,
    prefetch_first_tile,
    split_partials,
    store_decode_output,
)
from archserve.kernels.linear.triton_fp8_bits import e4m3_bits_to_fp16
from archserve.kernels.mla.decode_shared_memory import (
    DECODE_BLOCK_N,
    SMALLEST_BLOCK_N,
    ds_mla_max_stages,
    latent_tile_tokens,
)
from archserve.kernels.mla.triton_mla_output import latent_output_to_heads_triton
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from archserve.kernels.sparse_mla.layout import SparseMlaLayout
from archserve.kernels.sparse_mla.triton_rows import (
    TORCH_TO_TL,
    e4m3_read_as_bits,
    load_fp8_tiles,
    part_pointer,
)
from archserve.kernels.triton_dot import dot_precision
from archserve.platform.detect import device_info_for


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                       out_ptr, partial_out_ptr, partial_lse_ptr,
                       stride_q_token, stride_q_head, stride_out_token, stride_out_head,
                       stride_cache_block, stride_cache_token, stride_block_table,
                       qk_scale, v_scale,
                       NUM_HEADS: tl.constexpr, KV_RANK: tl.constexpr, ROPE: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, E4M3_BITS: tl.constexpr,
                       KEYS_AS_ROWS: tl.constexpr, PDL: tl.constexpr = False,
                       indices_ptr=None, row_seq_ptr=None, stride_indices=0,
                       INDEXED: tl.constexpr = False, DS_MLA: tl.constexpr = False,
                       SCALE_OFFSET: tl.constexpr = 0, ROPE_OFFSET: tl.constexpr = 0,
                       ROPE_DTYPE: tl.constexpr = None):
    # INDEXED (sparse MLA): axis 1 is a query row that attends to the positions listed in
    # its row of ``indices`` (seq_lens holds how many, query_start_loc is 0, 1, 2, ...) of
    # block-table row ``row_seq[row]``; keys [lo, hi) of a split are entries of that list.
    # DS_MLA: the cache is fp8_ds_mla rows as bytes (kernels/sparse_mla/layout.py).
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    # Metadata and older latents before PDL's wait, as in triton_decode's kernel (a row is
    # KV_RANK + ROPE <= 2 * BLOCK_L values).
    token, query_len, lo, hi, first_new = decode_split_range(
        query_start_loc_ptr, seq_lens_ptr, seq, split, 0, NUM_SPLITS, BLOCK_N)
    if INDEXED:
        index_row = indices_ptr + seq.to(tl.int64) * stride_indices
        block_table_row = (block_tables_ptr
                           + tl.load(row_seq_ptr + seq).to(tl.int64) * stride_block_table)
    else:
        index_row = indices_ptr
        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
        # (Not an indexed launch: its positions, a top-k kernel's output this step, are
        # read after the wait.)
        prefetch_first_tile(cache_ptr, cache_ptr, block_table_row, lo, hi,
                            first_new, stride_cache_block, stride_cache_token, BLOCK_SIZE,
                            BLOCK_N, KV_RANK + ROPE, 2 * BLOCK_L, False, PDL)
    pdl_start(PDL)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_l = offs_l < KV_RANK
    mask_r = offs_r < ROPE
    # (A sequence slot with no query token starts one row past the last: row 0 instead.)
    q_token = tl.where(query_len > 0, token, 0).to(tl.int64)
    q_rows = q_ptr + q_token * stride_q_token + heads[:, None] * stride_q_head
    q_nope = tl.load(q_rows + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_rows + KV_RANK + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                   other=0.0)
    if DOT_PRECISION == "ieee":  # the latent and P follow q's dtype (see dot_precision)
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    if KEYS_AS_ROWS:
        q_nope = tl.trans(q_nope)                 # [BLOCK_L, BLOCK_H]
        q_pe = tl.trans(q_pe)                     # [BLOCK_R, BLOCK_H]
        acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    else:
        acc, l_i, m_i = online_softmax_start(BLOCK_H, BLOCK_L)

    # Each tile's cache offsets are read one iteration ahead (paged_token_offsets says why).
    offs_n = lo + tl.arange(0, BLOCK_N)
    rows = paged_token_offsets(block_table_row,
                               _key_positions(index_row, offs_n, offs_n < hi, INDEXED),
                               offs_n < hi, stride_cache_block, stride_cache_token, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        c_kv, k_pe = _latent_tile(cache_ptr, rows, mask_n, offs_l, mask_l, offs_r, mask_r,
                                  KV_RANK, E4M3_BITS, DS_MLA, SCALE_OFFSET, ROPE_OFFSET,
                                  ROPE_DTYPE)
        c_kv = c_kv.to(q_nope.dtype)
        k_pe = k_pe.to(q_nope.dtype)
        next_n = offs_n + BLOCK_N
        rows = paged_token_offsets(block_table_row,
                                   _key_positions(index_row, next_n, next_n < hi, INDEXED),
                                   next_n < hi, stride_cache_block, stride_cache_token,
                                   BLOCK_SIZE)
        if KEYS_AS_ROWS:
            scores = tl.dot(c_kv, q_nope, input_precision=DOT_PRECISION)
            scores += tl.dot(k_pe, q_pe, input_precision=DOT_PRECISION)
            scores = tl.where(mask_n[:, None], scores * (qk_scale * 1.4426950408889634),
                              float("-inf"))
            acc, l_i, m_i = _softmax_step_keys_as_rows(acc, l_i, m_i, scores, c_kv,
                                                       DOT_PRECISION)
        else:
            scores = tl.dot(q_nope, tl.trans(c_kv), input_precision=DOT_PRECISION)
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
            scores = tl.where(mask_n[None, :], scores * (qk_scale * 1.4426950408889634),
                              float("-inf"))
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, c_kv, q_nope.dtype,
                                                DOT_PRECISION)

    if KEYS_AS_ROWS:
        acc = tl.trans(acc)                       # [BLOCK_H, BLOCK_L], as stored
    store_decode_output(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, token,
                        query_len, seq, split, lo < hi, NUM_HEADS, heads, mask_h, offs_l,
                        mask_l, stride_out_token, stride_out_head, v_scale, KV_RANK, NUM_SPLITS)


@triton.jit
def _key_positions(index_row, entries, mask, INDEXED: tl.constexpr):
    """The token positions of a tile's keys: the entries themselves (dense), or the
    positions an indexed row lists at those entries."""
    if INDEXED:
        positions = tl.load(index_row + entries, mask=mask, other=0)
    else:
        positions = entries
    return positions


@triton.jit
def _latent_tile(cache_ptr, rows, mask_n, offs_l, mask_l, offs_r, mask_r,
                 KV_RANK: tl.constexpr, E4M3_BITS: tl.constexpr, DS_MLA: tl.constexpr,
                 SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr,
                 ROPE_DTYPE: tl.constexpr):
    """(c_kv [N, BLOCK_L], k_pe [N, BLOCK_R]) of the cache rows at ``rows``: the latent as
    the cache holds it (an e4m3 cache read as bytes: value / 256, the wrapper scales by
    256), or an fp8_ds_mla row dequantized (c_kv's e4m3 bytes times their tile's scale,
    k_pe in ROPE_DTYPE at byte ROPE_OFFSET)."""
    mask_cl = mask_n[:, None] & mask_l[None, :]
    mask_pe = mask_n[:, None] & mask_r[None, :]
    if DS_MLA:
        c_kv = load_fp8_tiles(cache_ptr, rows, mask_n, offs_l, mask_l, 0, SCALE_OFFSET,
                              KV_RANK, E4M3_BITS)
        rope = part_pointer(cache_ptr, rows, ROPE_OFFSET, ROPE_DTYPE)
        k_pe = tl.load(rope[:, None] + offs_r[None, :], mask=mask_pe, other=0.0)
    else:
        c_kv = tl.load(cache_ptr + rows[:, None] + offs_l[None, :], mask=mask_cl, other=0.0)
        k_pe = tl.load(cache_ptr + rows[:, None] + KV_RANK + offs_r[None, :], mask=mask_pe,
                       other=0.0)
        if E4M3_BITS:   # bytes -> value / 256 (the wrapper scales by 256)
            c_kv = e4m3_bits_to_fp16(c_kv)
            k_pe = e4m3_bits_to_fp16(k_pe)
    return c_kv, k_pe


@triton.jit
def _softmax_step_keys_as_rows(acc, l_i, m_i, scores, c_kv, DOT_PRECISION: tl.constexpr):
    """online_softmax_step with keys as rows: ``scores`` [N, H] in log2 units (-inf where
    masked), ``acc`` [L, H] += c_kvᵀ [L, N] . p [N, H]."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(c_kv), p.to(c_kv.dtype),
                                        input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Three stages where a launch has at most this many splits (a batch of 64 sequences or
# more) of at least PIPELINED_MIN_TILES tiles each (by the longest context it may see).
PIPELINED_MAX_SPLITS = 4
PIPELINED_MIN_TILES = 8
# Shared memory a program of the rule's tiles takes at three stages: two 32 x 576 bf16 latent
# tiles and the kernel's scratch, 93,184 bytes for sm_90 (ncu). A GPU whose blocks may use
# less (an MI300's 64 KiB) runs two.
THREE_STAGE_SHARED_BYTES = 96 << 10


def mla_decode_tiles(num_heads: int, num_splits: int = 1, max_seq_len: int = 1 << 30,
                     max_stages: int = 3, block_n: int = DECODE_BLOCK_N
                     ) -> tuple[int, int, int, int, bool]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages, KEYS_AS_ROWS) for a launch of
    ``num_splits`` splits over contexts up to ``max_seq_len``, on a GPU that fits
    ``max_stages`` and latent tiles of ``block_n`` tokens (decode_shared_memory.py: 32, or
    16 on a GPU below SM80 whose shared memory holds no more). 16 heads per program: tl.dot's smallest M, and its [16, 512] fp32
    accumulator fits 4 warps' registers; more heads per program would spill. A 32-token
    latent tile is 36 KiB in bf16. (16-token tiles, measured in a chain of batch-1 launches
    with the merge and W_UV on the H200: 7.25 µs a launch against 7.91 at 384 tokens, 18.60
    against 15.38 at 4096: not taken.)

    Two stages keep one tile in shared memory: each tile is loaded after the previous one's
    products. Three keep two, so the next tile streams during this one's products: on the
    H200, 64 x 4096 with 16 heads and 4 splits ran 98.5 µs (74% of copy; two stages: 115-125
    µs), and V2-Lite's 256 x 1024/128 step 14.64 ms against 15.21. But a batch-1 step split 32 ways, a tile or two a split, lost 0.12 ms
    with three (2.056 against 1.937 ms): there is nothing to overlap, and the pipelined loop
    costs more than it hides. So three stages only for a few long splits (a split of
    PIPELINED_MIN_TILES tiles or more, no more than PIPELINED_MAX_SPLITS of them). The
    engine times KEYS_AS_ROWS tiles against these at start-up and launches the faster
    (kernels/mla/tuning.py)."""
    long_splits = (num_splits <= PIPELINED_MAX_SPLITS
                   and max_seq_len >= num_splits * PIPELINED_MIN_TILES * block_n)
    return 16, block_n, 4, min(max_stages, 3 if long_splits else 2), False


def _max_stages(device: torch.device) -> int:
    """3 where a block may take THREE_STAGE_SHARED_BYTES of shared memory (and on the CPU,
    whose interpreter has no limit), else 2."""
    info = device_info_for(device)
    if not info.is_gpu:
        return 3
    return 3 if (info.shared_memory_per_block_bytes or 0) >= THREE_STAGE_SHARED_BYTES else 2


# Programs of the rule's tiles one SM holds at once: 4 warps at 206 registers a thread (ncu,
# H200) fit twice in 64K registers. The split rule aims at that many: at 64 x 4096 (16
# heads, three stages), 4 splits ran at 98.1 µs (75% of copy) against 105.0 for the 8 that
# aimed at four.
MLA_PROGRAMS_PER_SM = 2


def mla_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int,
                   block_h: int) -> int:
    """The split rule's count for the decode kernel (``choose_num_splits`` over the
    sequences' head blocks)."""
    return choose_num_splits(num_seqs, triton.cdiv(num_heads, block_h), max_seq_len, num_sms,
                             MLA_PROGRAMS_PER_SM)


def mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, *,
               num_seqs: int, max_seq_len: int, scale: float, k_scale: float = 1.0,
               num_sms: int = 0, num_splits: int | None = None,
               tiles: tuple[int, int, int, int] | None = None,
               e4m3_bits: bool | None = None, w_uv: torch.Tensor | None = None,
               indices: torch.Tensor | None = None, row_seq: torch.Tensor | None = None,
               layout: SparseMlaLayout | None = None) -> torch.Tensor:
    """Attend one absorbed query token per sequence over its paged latent; writes ``out``,
    or with ``w_uv`` [H, v, L] returns the heads' values [T, H, v] (the merge and W_UV in
    one kernel: triton_mla_output.py; ``out`` is then scratch).

    query [T, H, L + R] (row ``query_start_loc[i]`` belongs to sequence i), kv_cache
    [1, num_blocks, block_size, 1, L + R], out [T, H, L] with L = ``out.shape[-1]``.
    ``num_splits`` overrides the split rule (a power of two), ``tiles`` the
    ``mla_decode_tiles`` (both for benchmark sweeps); ``e4m3_bits`` reads an e4m3 cache as
    bytes (None: where the GPU lacks e4m3).

    Sparse MLA: ``layout`` says how kv_cache's rows hold the latent (kernels/sparse_mla/
    layout.py: the model dtype beside an indexer key, or fp8_ds_mla). With ``indices``
    [T, topk] each query row attends to the positions its row lists, of block-table row
    ``row_seq[row]``; ``seq_lens`` then counts each row's entries, ``query_start_loc`` is
    0, 1, ..., T, num_seqs is T, and max_seq_len the most entries a row may have.
    """
    _, num_heads, latent_size = query.shape
    kv_rank = out.shape[-1]
    rope = latent_size - kv_rank
    sparse = {}
    if layout is not None and layout.latent_fp8:
        sparse = dict(DS_MLA=True, SCALE_OFFSET=layout.scale_offset,
                      ROPE_OFFSET=layout.rope_offset,
                      ROPE_DTYPE=TORCH_TO_TL[layout.model_dtype])
    elif layout is not None:
        kv_cache = layout.latent_view(kv_cache)
    assert kv_cache.shape[0] == 1 and kv_cache.shape[3] == 1
    assert sparse or kv_cache.shape[4] == latent_size
    assert rope > 0, "the kernel reads a rope part (qk_rope_head_dim > 0)"
    assert kv_cache.stride(-1) == 1 and query.stride(-1) == 1 and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    block_size = kv_cache.shape[2]
    if sparse:   # bytes; the tiles dequantize themselves
        kv_cache = kv_cache.view(torch.uint8)
        bits = e4m3_read_as_bits(out.device) if e4m3_bits is None else e4m3_bits
        v_scale = k_scale
    else:
        kv_cache, bits = cache_operand(kv_cache, e4m3_bits)
        v_scale = k_scale * (E4M3_BITS_SCALE if bits else 1.0)
    if indices is not None:
        sparse.update(indices_ptr=indices, row_seq_ptr=row_seq,
                      stride_indices=indices.stride(0), INDEXED=True)
    block_h = (tiles or mla_decode_tiles(num_heads))[0]
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = mla_num_splits(num_seqs, num_heads, max_seq_len, num_sms, block_h)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    block_h, block_n, num_warps, num_stages, keys_as_rows = tiles or mla_decode_tiles(
        num_heads, num_splits, max_seq_len,
        ds_mla_max_stages(device_info_for(out.device)) if sparse.get("DS_MLA")
        else _max_stages(out.device),
        latent_tile_tokens(device_info_for(out.device), kv_rank) or SMALLEST_BLOCK_N)
    block_l = triton.next_power_of_2(kv_rank)
    partial_out, partial_lse = split_partials(out, num_seqs, num_heads, num_splits, kv_rank)
    pdl = pdl_enabled(out.device)
    _mla_decode_kernel[(head_blocks, num_seqs, num_splits)](
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, partial_out, partial_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        scale * v_scale, v_scale,
        NUM_HEADS=num_heads, KV_RANK=kv_rank, ROPE=rope, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_L=block_l,
        BLOCK_R=max(triton.next_power_of_2(rope), 16), NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(query.dtype), E4M3_BITS=bits, KEYS_AS_ROWS=keys_as_rows,
        PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **sparse, **pdl_launch_options(pdl),
    )
    if num_splits > 1:
        if w_uv is not None:
            return latent_output_to_heads_triton(partial_out, partial_lse, query_start_loc,
                                                 num_seqs, out.shape[0], w_uv, v_scale,
                                                 seq_lens=seq_lens, split_block_n=block_n)
        merge_splits(partial_out, partial_lse, query_start_loc, seq_lens, out, v_scale,
                     split_block_n=block_n)
    if w_uv is not None:   # the kernel wrote the scaled output
        return latent_output_to_heads_triton(out, out, query_start_loc, num_seqs,
                                             out.shape[0], w_uv)
    return out
