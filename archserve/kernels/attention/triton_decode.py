"""Triton paged decode attention: one query token per sequence, GQA-aware, split-KV.

One program owns (sequence, KV head, split) and computes every query head of that KV head's
group, so each cached K/V tile is read from memory once per group instead of once per query
head. The group is the M dimension of a ``tl.dot``, padded to 16 rows, for every group size:
decode is bound by memory, so the padded math costs nothing, while the broadcast-multiply-
reduce it replaced ran Qwen3-0.6B's 2-head groups at about an eighth of the bandwidth on an
H200 (14.4 ms of a 17.5 ms batch-256 step).

When sequences x KV heads cannot fill the GPU, the context is split into ``num_splits``
chunks (flash-decoding); each writes a partial output and its log-sum-exp, and a small second
kernel merges them. (Merging in the split that arrives last, with no second kernel, was
measured slower on an H200 with PDL, which schedules the merge while the splits drain.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_cache_write import (
    E4M3_BITS_SCALE,
    cache_operand,
    load_kv_rows,
    paged_token_offsets,
)
from archserve.kernels.pdl import (
    pdl_enabled,
    pdl_launch_options,
    pdl_start,
    prefetch_rows_to_l2,
)
from archserve.kernels.triton_dot import dot_precision

LOG2E = 1.4426950408889634
# Split-KV rule, from an H200 sweep timed as CUDA-graph replays (benchmarks/bench_attention.py
# --split-sweep; bf16, head 128, 8 KV heads): 8 x 512 tokens ran at 27% of bandwidth unsplit
# and 45% with 8 splits of 64 tokens; 8 x 4096 at 25% -> 80% with 8 splits; 1 x 2048 at 4% ->
# 24% with 16. Splits pay down to one 64-token tile each, and about four programs per SM.
MIN_TOKENS_PER_SPLIT = 64
PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
# The split merge's warps: up to MERGE_ONE_WARP_VALUES partial values (splits x head size)
# one warp holds a head's partials and reduces over the splits in its own registers, with
# no block barrier (H200 chain, 16 splits x 128: 1.16 µs a launch against 1.21 with 4
# warps). Past it one warp's registers spill (ptxas, sm_90a: 32 x 256 spills), so 4 warps.
MERGE_ONE_WARP_VALUES = 2048


@triton.jit
def soft_cap_scores(scores, soft_cap):
    """cap * tanh(s / cap), with tanh written through exp2 so it runs on every target."""
    x = scores / soft_cap
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return soft_cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def online_softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (acc, l_i, m_i) of ``online_softmax_step`` before any key: nothing seen yet."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return acc, l_i, m_i


@triton.jit
def sink_start(l_i, m_i, sinks_ptr, heads, mask, split):
    """``online_softmax_start``'s state with each row's attention sink already seen: its
    logit (``sinks[heads]``, scaled-score units, here in log2 units) as the running max,
    and exp of it against itself, 1, as the denominator; it adds no value to ``acc``.
    Only split 0 takes the sinks (the merge joins the later splits with it); masked rows
    keep the empty state."""
    # (split as a vector: the interpreter mistypes scalar-bool & tensor)
    keep = mask & ((heads * 0 + split) == 0)
    sink = tl.load(sinks_ptr + heads, mask=keep, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(keep, 1.0, l_i), tl.where(keep, sink, m_i)


@triton.jit
def online_softmax_step(acc, l_i, m_i, scores, v, DOT_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Fold one tile of keys into a running softmax (flash attention): ``scores`` [M, N] in
    log2 units, -inf where masked; ``v`` [N, D], multiplied by P in DOT_DTYPE (the query's).
    Returns the new (acc, l_i, m_i)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row may see no allowed key in a tile (prefill's window edge): keep its exponents finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _split_tokens(query_start_loc_ptr, seq_lens_ptr, seq, SLIDING_WINDOW: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(query row, query length, context start, context end, keys a split): the context
    (its last SLIDING_WINDOW tokens, with a window) cut into NUM_SPLITS spans of whole
    BLOCK_N tiles. Elementwise: ``seq`` may be a vector of sequences."""
    token = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token
    seq_len = tl.load(seq_lens_ptr + seq)
    # A sequence with no query token this step (graph padding) attends to nothing.
    seq_len = tl.where(query_len > 0, seq_len, 0)
    context_start = seq_len * 0
    if SLIDING_WINDOW > 0:
        context_start = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - context_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return token, query_len, context_start, seq_len, tokens_per_split


@triton.jit
def decode_split_range(query_start_loc_ptr, seq_lens_ptr, seq, split,
                       SLIDING_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """(the sequence's query row, its query length, the keys [lo, hi) of split ``split``,
    and the first position this step writes): the keys before the first written position
    were cached by earlier steps. A split with lo >= hi holds no keys and stores nothing
    (a short context fills the first ``active_splits`` only)."""
    token, query_len, context_start, seq_len, tokens_per_split = _split_tokens(
        query_start_loc_ptr, seq_lens_ptr, seq, SLIDING_WINDOW, NUM_SPLITS, BLOCK_N)
    lo = context_start + split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)
    return token, query_len, lo, hi, seq_len - query_len


@triton.jit
def active_splits(query_start_loc_ptr, seq_lens_ptr, seq, SLIDING_WINDOW: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many of ``decode_split_range``'s splits hold keys: the first ones, the rest store
    no partials, so a merge reads only these. Zero for a sequence with no query token. From
    the step's inputs alone: a merge computes it before PDL's wait. Elementwise in ``seq``."""
    _, _, context_start, seq_len, tokens_per_split = _split_tokens(
        query_start_loc_ptr, seq_lens_ptr, seq, SLIDING_WINDOW, NUM_SPLITS, BLOCK_N)
    return tl.cdiv(seq_len - context_start, tl.maximum(tokens_per_split, 1))


@triton.jit
def store_decode_output(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, token,
                        query_len, seq, split, active, num_heads, heads, mask_h, offs_d, mask_d,
                        stride_out_token, stride_out_head, v_scale,
                        HEAD_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Normalise one program's rows (query heads ``heads`` of sequence ``seq``) and store
    them: times v_scale into ``out`` when the context is not split; else unscaled as fp32
    partials [num_seqs, num_heads, NUM_SPLITS, (HEAD_SIZE)] with their log-sum-exp in log2
    units, for ``merge_splits`` (which applies v_scale), where the split is ``active`` (holds
    keys: a merge reads the ``active_splits`` only)."""
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = mask_h[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        dst = (out_ptr + token.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head
               + offs_d[None, :])
        # (broadcast before comparing: the interpreter mistypes scalar-bool & tensor)
        live = (tl.zeros(acc.shape, tl.int32) + query_len) > 0
        tl.store(dst, (out * v_scale).to(out_ptr.dtype.element_ty), mask=out_mask & live)
    else:
        row = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        # (broadcast: the interpreter mistypes scalar-bool & tensor)
        keep = (tl.zeros(acc.shape, tl.int32) + active.to(tl.int32)) > 0
        tl.store(partial_out_ptr + row[:, None] * HEAD_SIZE + offs_d[None, :], out,
                 mask=out_mask & keep)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        keep_lse = (tl.zeros(l_i.shape, tl.int32) + active.to(tl.int32)) > 0
        tl.store(partial_lse_ptr + row, lse, mask=mask_h & keep_lse)


@triton.jit
def prefetch_first_tile(k_base, v_base, block_table_row_ptr, lo, hi, first_new,
                        stride_cache_block, stride_cache_token, BLOCK_SIZE: tl.constexpr,
                        BLOCK_N: tl.constexpr, ROW_ELEMENTS: tl.constexpr,
                        ROW_POW2: tl.constexpr, HAS_V: tl.constexpr, PDL: tl.constexpr):
    """Before PDL's wait: the L2 prefetch of the first tile's cached rows (positions from
    ``lo``, below ``hi`` and ``first_new``) of ROW_ELEMENTS each (ROW_POW2: the power of two
    at or above it), keys and (HAS_V) values.
    The metadata is never written by the kernel before (kernels/pdl.py). A prefetch only
    warms L2, where every SM's writes land, so it cannot return stale values; the rows
    worth fetching early are the older ones, which stream while that kernel drains, and the
    tile's loads after the wait find them in L2."""
    if PDL:
        positions = lo + tl.arange(0, BLOCK_N)
        cached = (positions < hi) & (positions < first_new)
        rows = paged_token_offsets(block_table_row_ptr, positions, cached, stride_cache_block,
                                   stride_cache_token, BLOCK_SIZE)
        prefetch_rows_to_l2(k_base + rows, cached, ROW_ELEMENTS, ROW_POW2, PDL)
        if HAS_V:
            prefetch_rows_to_l2(v_base + rows, cached, ROW_ELEMENTS, ROW_POW2, PDL)


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                   out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr,
                   stride_q_token, stride_q_head, stride_out_token, stride_out_head,
                   stride_cache_kv, stride_cache_block, stride_cache_token, stride_cache_head,
                   stride_block_table, qk_scale, v_scale, soft_cap,
                   GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                   USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   E4M3_BITS: tl.constexpr, PDL: tl.constexpr = False,
                   SINKS: tl.constexpr = False):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The metadata is never written by the kernel before (kernels/pdl.py): read before
    # PDL's wait.
    token, query_len, lo, hi, first_new = decode_split_range(
        query_start_loc_ptr, seq_lens_ptr, seq, split, SLIDING_WINDOW, NUM_SPLITS, BLOCK_N)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    k_base = cache_ptr + kv_head * stride_cache_head
    prefetch_first_tile(k_base, k_base + stride_cache_kv, block_table_row, lo, hi,
                        first_new, stride_cache_block, stride_cache_token, BLOCK_SIZE,
                        BLOCK_N, HEAD_SIZE, BLOCK_D, True, PDL)
    pdl_start(PDL)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_SIZE
    heads = kv_head * GROUP + offs_g
    # A sequence slot with no query token (a padded bucket) starts at row T, one past the
    # last: it reads row 0 instead, and stores nothing.
    q_token = tl.where(query_len > 0, token, 0).to(tl.int64)
    q = tl.load(q_ptr + q_token * stride_q_token + heads[:, None] * stride_q_head
                + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_PRECISION == "ieee":  # K, V and P follow q's dtype (see dot_precision)
        q = q.to(tl.float32)

    acc, l_i, m_i = online_softmax_start(BLOCK_G, BLOCK_D)
    if SINKS:
        # The first split carries the sinks: its log-sum-exp then holds their mass, and
        # the merge weighs every split against it.
        l_i, m_i = sink_start(l_i, m_i, sinks_ptr, heads, mask_g, split)
    v_base = k_base + stride_cache_kv

    # The cache offsets in the same iteration (unlike MLA decode, paged_token_offsets): an
    # SM holds many of these light programs, which overlap one another's loads; on the
    # H200 the carried form measured the same at 256 x 512 and was not compared at 64 x 4096.
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = paged_token_offsets(block_table_row, offs_n, mask_n, stride_cache_block,
                                   stride_cache_token, BLOCK_SIZE)
        k, v = load_kv_rows(k_base, v_base, rows, mask_n, offs_d, mask_d, E4M3_BITS)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = scores * qk_scale
        if USE_SOFT_CAP:
            scores = soft_cap_scores(scores, soft_cap)
        scores = tl.where(mask_n[None, :], scores * 1.4426950408889634, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, v, q.dtype, DOT_PRECISION)

    store_decode_output(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, token,
                        query_len, seq, split, lo < hi, tl.num_programs(1) * GROUP, heads,
                        mask_g, offs_d, mask_d, stride_out_token, stride_out_head, v_scale,
                        HEAD_SIZE, NUM_SPLITS)


@triton.jit
def _merge_splits_kernel(partial_out_ptr, partial_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
                         out_ptr, stride_out_token, stride_out_head, v_scale,
                         HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                         SPLIT_BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # The step's inputs, before PDL's wait: which splits hold keys (SPLIT_BLOCK_N: the split
    # kernel's BLOCK_N); the others stored nothing, and their rows are not read.
    token = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token
    num_active = active_splits(query_start_loc_ptr, seq_lens_ptr, seq, SLIDING_WINDOW,
                               NUM_SPLITS, SPLIT_BLOCK_N)
    pdl_start(PDL)
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_SIZE
    mask_s = offs_s < num_active
    lse = tl.load(partial_lse_ptr + row0 + offs_s, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # Splits without keys weigh 0; a sequence with no query token has none (its row is not
    # written).
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(partial_out_ptr + (row0 + offs_s)[:, None] * HEAD_SIZE + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    dst = out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + offs_d
    live = (tl.zeros([BLOCK_D], tl.int32) + query_len) > 0
    tl.store(dst, (out * v_scale).to(out_ptr.dtype.element_ty), mask=mask_d & live)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Split the context only when sequences x KV heads leave SMs idle.

    Aims at about ``programs_per_sm`` programs per SM (PROGRAMS_PER_SM, from GQA decode's
    split sweep; MLA decode passes the two of its programs an SM holds at once), never
    below MIN_TOKENS_PER_SPLIT tokens per split; a power of two so the number of compiled
    variants stays small.
    """
    programs = num_seqs * num_kv_heads
    if num_sms <= 0 or programs >= num_sms:
        return 1
    wanted = triton.cdiv(programs_per_sm * num_sms, programs)
    useful = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    splits = min(wanted, useful, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def split_partials(out: torch.Tensor, num_seqs: int, num_heads: int, num_splits: int,
                   head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, their log-sum-exps): the fp32 buffers that split programs write
    and ``merge_splits`` reads. With one split the kernels write ``out`` directly, and
    ``out`` stands in for both."""
    if num_splits == 1:
        return out, out
    partial_out = torch.empty((num_seqs, num_heads, num_splits, head_size),
                              dtype=torch.float32, device=out.device)
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                              device=out.device)
    return partial_out, partial_lse


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 v_scale: float, *, split_block_n: int, sliding_window: int | None = None
                 ) -> None:
    """Merge ``split_partials``' buffers into each sequence's query row of ``out``, times
    ``v_scale``: the partials of the splits that hold keys, as ``decode_split_range`` cut
    the contexts (``seq_lens``, the window, ``split_block_n``: the split kernel's BLOCK_N)."""
    num_seqs, num_heads, num_splits, head_size = partial_out.shape
    pdl = pdl_enabled(out.device)
    _merge_splits_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, query_start_loc, seq_lens, out, out.stride(0), out.stride(1),
        v_scale, HEAD_SIZE=head_size, BLOCK_D=triton.next_power_of_2(head_size),
        NUM_SPLITS=num_splits, SLIDING_WINDOW=sliding_window or 0, SPLIT_BLOCK_N=split_block_n,
        PDL=pdl, num_warps=1 if num_splits * triton.next_power_of_2(head_size)
        <= MERGE_ONE_WARP_VALUES else 4, **pdl_launch_options(pdl),
    )


def decode_tiles(head_size: int, group: int, split_tokens: int | None = None
                 ) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Decode is bandwidth-bound: the loads in flight come
    from the many light programs an SM holds (two stages give a program one tile buffer).
    (Whether another tile is faster is not measured: the tile sweeps that found every tile
    within 1% of the others did not pass the swept tiles to the kernel.)

    ``split_tokens``: the most keys a split holds at the launch's longest context. Splits
    as short as ``choose_num_splits`` makes them (MIN_TOKENS_PER_SPLIT: a small batch's
    graph where max_model_len is that times the splits, e.g. 1024 at 16) take 32-token
    tiles: a short context then fills twice the splits, each half the work, and the step
    waits on the slowest (H200, Qwen3-30B-A3B's batch 1 at 384 tokens, max_model_len 1024:
    decode and merge 3.57 µs a launch in a chain against 4.21; bench_chain_latency.py).
    Longer splits keep 64-token tiles: not measured with 32."""
    if head_size > 128 or (split_tokens is not None
                            and split_tokens <= MIN_TOKENS_PER_SPLIT):
        return 32, 4, 2
    return 64, 4, 2


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
                     *, num_seqs: int, max_seq_len: int, scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, num_sms: int = 0,
                     num_splits: int | None = None,
                     tiles: tuple[int, int, int] | None = None,
                     e4m3_bits: bool | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attend one query token per sequence over its paged context; writes into ``out``.

    query/out [T, H, D] (row ``query_start_loc[i]`` belongs to sequence i), kv_cache in the
    engine layout. ``num_splits`` overrides the split heuristic (a power of two), ``tiles``
    the (BLOCK_N, num_warps, num_stages) of ``decode_tiles`` (both for benchmark sweeps).
    Head sizes need not be powers of two: the kernel pads to the next one and masks.
    ``e4m3_bits`` reads an e4m3 cache as bytes (None: where the GPU lacks e4m3).
    ``sinks`` [H]: each query head's attention sink logit (AttentionLayerParams.sinks).
    """
    _, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return out
    kv_cache, bits = cache_operand(kv_cache, e4m3_bits)
    if bits:
        k_scale, v_scale = k_scale * E4M3_BITS_SCALE, v_scale * E4M3_BITS_SCALE
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    block_n, num_warps, num_stages = tiles or decode_tiles(
        head_size, group, triton.cdiv(max_seq_len, num_splits) if num_splits > 1 else None)
    block_g = max(triton.next_power_of_2(group), 16)  # tl.dot needs M >= 16
    block_d = triton.next_power_of_2(head_size)
    partial_out, partial_lse = split_partials(out, num_seqs, num_heads, num_splits, head_size)
    pdl = pdl_enabled(out.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, partial_out, partial_lse,
        sinks if sinks is not None else seq_lens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), scale * k_scale, v_scale, soft_cap or 1.0,
        GROUP=group, HEAD_SIZE=head_size, BLOCK_SIZE=block_size, BLOCK_G=block_g,
        BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        SLIDING_WINDOW=sliding_window or 0, USE_SOFT_CAP=soft_cap is not None and soft_cap > 0,
        DOT_PRECISION=dot_precision(query.dtype), E4M3_BITS=bits, num_warps=num_warps,
        num_stages=num_stages, PDL=pdl, SINKS=sinks is not None, **pdl_launch_options(pdl),
    )
    if num_splits > 1:
        merge_splits(partial_out, partial_lse, query_start_loc, seq_lens, out, v_scale,
                     split_block_n=block_n, sliding_window=sliding_window)
    return out
