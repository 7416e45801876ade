"""Triton paged prefill / chunked-prefill attention over a varlen batch (the general case).

Flash-attention style: a program owns BLOCK_M query rows of one sequence and one query head,
and streams BLOCK_N-key tiles from the paged cache through the block table with an online
softmax. This step's tokens are already in the cache, so the prefix and the new tokens are read
the same way. Key tiles wholly below the causal diagonal run without masks; only the tiles
that cross it (or the sliding window's lower edge) pay for masking; tiles above it are skipped.

A launch may also be given a key window [key_lo, key_hi) of every sequence's positions (keys
outside it are neither read nor attended) and an LSE output: the log of each row's softmax
denominator. A context too large for one pass is then attended window by window and the
partial results merged by their LSEs (kernels/mla/expanded_prefill.py does so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_cache_write import (
    E4M3_BITS_SCALE,
    cache_operand,
    load_kv_rows,
    paged_token_offsets,
)
from archserve.kernels.attention.triton_decode import (
    online_softmax_start,
    online_softmax_step,
    sink_start,
    soft_cap_scores,
)
from archserve.kernels.rules import triton_interpreted
from archserve.kernels.triton_dot import dot_has_tensor_cores, dot_precision
from archserve.platform.detect import device_info_for

if TYPE_CHECKING:
    from archserve.platform.device import DeviceInfo


@triton.jit
def _attend_key_tiles(acc, l_i, m_i, q, q_pos, lo, hi, seq_len, k_base, v_base,
                      block_table_row, stride_cache_block, stride_cache_token, qk_scale,
                      soft_cap, offs_d, mask_d, key_lo,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                      MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      E4M3_BITS: tl.constexpr, KEY_WINDOW: tl.constexpr = False):
    # A tile's rows ``limit`` and beyond read nothing: the sequence's end where MASKED (the
    # last tile may reach past hi), else hi (always past the tile here; kept so the loads
    # share one shape of code). The next tile's offsets take the same mask as its loads.
    # KEY_WINDOW (masked tiles): keys below key_lo are not read either; seq_len is then
    # already the window's end.
    limit = seq_len if MASKED else hi
    # Each tile's cache offsets are read one iteration ahead (paged_token_offsets says why).
    offs_n = lo + tl.arange(0, BLOCK_N)
    rows = paged_token_offsets(block_table_row, offs_n, offs_n < limit, stride_cache_block,
                               stride_cache_token, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < limit
        if KEY_WINDOW and MASKED:
            mask_n = mask_n & (offs_n >= key_lo)
        k, v = load_kv_rows(k_base, v_base, rows, mask_n, offs_d, mask_d, E4M3_BITS)
        rows = paged_token_offsets(block_table_row, offs_n + BLOCK_N, offs_n + BLOCK_N < limit,
                                   stride_cache_block, stride_cache_token, BLOCK_SIZE)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFT_CAP:
            scores = soft_cap_scores(scores, soft_cap)
        scores = scores * 1.4426950408889634
        if MASKED:
            allowed = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            if SLIDING_WINDOW > 0:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            scores = tl.where(allowed, scores, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, v, q.dtype, DOT_PRECISION)
    return acc, l_i, m_i


# Binary-search steps of the flat grid: enough for 2**16 sequences in one step.
FLAT_SEARCH_STEPS: tl.constexpr = tl.constexpr(16)


# num_seqs is read by the flat grid only: not specialised, so its value (1, a multiple of
# 16) compiles no variant of its own.
# key_lo / key_hi change with every window of a chunked context: not specialised either.
@triton.jit(do_not_specialize=["num_seqs", "key_lo", "key_hi"])
def _prefill_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                    out_ptr, sinks_ptr, stride_q_token, stride_q_head, stride_out_token, stride_out_head,
                    stride_cache_kv, stride_cache_block, stride_cache_token, stride_cache_head,
                    stride_block_table, qk_scale, v_scale, soft_cap, tune_bucket, num_seqs,
                    lse_ptr, stride_lse_token, key_lo, key_hi,
                    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, E4M3_BITS: tl.constexpr,
                    FLAT_GRID: tl.constexpr, SINKS: tl.constexpr = False,
                    KEY_WINDOW: tl.constexpr = False, WRITE_LSE: tl.constexpr = False):
    if FLAT_GRID:
        # One axis of query tiles over every sequence: sequence s owns the programs from
        # query_start_loc[s] // BLOCK_M + s on (at least its cdiv(query_len, BLOCK_M)
        # tiles), found by a binary search. A grid of tokens / BLOCK_M + sequences then
        # covers any batch of that many tokens and sequences, and empty sequence slots
        # (a captured bucket's padding) cost no program each.
        flat = tl.program_id(0)
        lo = num_seqs * 0          # an integer of num_seqs' type: carried through the loop
        hi = num_seqs - 1
        for _ in range(FLAT_SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            owns = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= flat
            lo = tl.where(owns, mid, lo)
            hi = tl.where(owns, hi, mid - 1)
        seq = lo
        m_block = flat - (tl.load(query_start_loc_ptr + seq) // BLOCK_M + seq)
        head = tl.program_id(1)
    else:
        m_block = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < query_len
    mask_d = offs_d < HEAD_SIZE
    q_pos = prefix_len + offs_m
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_PRECISION == "ieee":  # K, V and P follow q's dtype (see dot_precision)
        q = q.to(tl.float32)

    first_q_pos = prefix_len + m_block * BLOCK_M
    # Keys past the tile's last query are never visible (causal), nor past the sequence.
    hi = tl.minimum(seq_len, first_q_pos + BLOCK_M)
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        unmasked_end = lo  # the window's lower edge moves per row: mask every tile
    else:
        lo = 0
        # Keys <= first_q_pos are visible to every row of the tile.
        unmasked_end = ((first_q_pos + 1) // BLOCK_N) * BLOCK_N

    acc, l_i, m_i = online_softmax_start(BLOCK_M, BLOCK_D)
    if SINKS:   # every row of the tile is the same query head's
        l_i, m_i = sink_start(l_i, m_i, sinks_ptr, head + offs_m * 0, mask_m, 0)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv

    if KEY_WINDOW:
        # Three spans: the tile holding key_lo (masked, when key_lo is not on a tile edge),
        # the whole tiles every row sees (unmasked), then the masked rest up to the window's
        # end. A span whose start is past its end runs no tile.
        lo = tl.maximum(lo, (key_lo // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, key_hi)
        window_end = tl.minimum(seq_len, key_hi)
        edge = tl.maximum(lo, tl.cdiv(key_lo, BLOCK_N) * BLOCK_N)
        unmasked_end = tl.maximum(edge, tl.minimum(unmasked_end, (hi // BLOCK_N) * BLOCK_N))
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, lo, edge, window_end, k_base, v_base, block_table_row,
            stride_cache_block, stride_cache_token, qk_scale, soft_cap, offs_d, mask_d, key_lo,
            BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, USE_SOFT_CAP, True, DOT_PRECISION, E4M3_BITS,
            True)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, edge, unmasked_end, window_end, k_base, v_base,
            block_table_row, stride_cache_block, stride_cache_token, qk_scale, soft_cap,
            offs_d, mask_d, key_lo, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, USE_SOFT_CAP, False,
            DOT_PRECISION, E4M3_BITS, True)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, unmasked_end, hi, window_end, k_base, v_base,
            block_table_row, stride_cache_block, stride_cache_token, qk_scale, soft_cap,
            offs_d, mask_d, key_lo, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, USE_SOFT_CAP, True,
            DOT_PRECISION, E4M3_BITS, True)
    else:
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, lo, unmasked_end, seq_len, k_base, v_base,
            block_table_row, stride_cache_block, stride_cache_token, qk_scale, soft_cap,
            offs_d, mask_d, key_lo, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, USE_SOFT_CAP, False,
            DOT_PRECISION, E4M3_BITS)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, unmasked_end, hi, seq_len, k_base, v_base,
            block_table_row, stride_cache_block, stride_cache_token, qk_scale, soft_cap,
            offs_d, mask_d, key_lo, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, USE_SOFT_CAP, True,
            DOT_PRECISION, E4M3_BITS)

    seen = l_i > 0.0
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    dst = out_ptr + tokens[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    if WRITE_LSE:
        # Natural log of the denominator, max included (m_i and the scores are in log2
        # units); -inf for a row that saw no key.
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(lse_ptr + tokens * stride_lse_token + head, lse, mask=mask_m)


# Autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), tried once per head size and
# dtype. The largest fit Hopper's shared memory (bf16, head 128, 4 x 4096 causal on an H200:
# 128x128/8 warps/3 stages ~325 TFLOP/s); configs that overflow a smaller GPU's shared memory
# fail to compile and the autotuner drops them, so the small ones keep every GPU covered.
PREFILL_CONFIGS = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2),
                   (64, 32, 4, 2), (32, 32, 4, 1)]


def _prefill_tiles(head_size: int, dtype: torch.dtype, device: DeviceInfo
                   ) -> tuple[int, int, int, int]:
    """Tiles for when the autotuner is not used: the CPU interpreter (where time is per op),
    and every tl.dot on CUDA cores (fp32's "ieee" products; 16-bit ones below SM80, see
    dot_has_tensor_cores). There the operands sit in registers as fp32: at head size 128 on
    sm_75 a 128x64 tile of 4 warps spills 21.9 KB a thread to local memory, 64x64 8.1 KB,
    32x32 0.7 KB (and they compile in 45, 18 and 3 s), so the smallest tile runs untuned."""
    if (dtype == torch.float32 or head_size > 128
            or (device.is_gpu and not dot_has_tensor_cores(device))):
        return 32, 32, 4, 1
    return 64, 64, 4, 2


def prefill_tile_smem_bytes(block_m: int, block_n: int, num_stages: int, block_d: int,
                            element_size: int) -> int:
    """Shared memory a tile needs, roughly: the Q tile plus K and V tiles for each of the
    pipeline's in-flight stages (num_stages - 1, at least one)."""
    return element_size * block_d * (block_m + 2 * block_n * max(1, num_stages - 1))


def fitting_prefill_configs(configs: list, smem_limit: int, block_d: int,
                            element_size: int) -> list:
    """The configs whose tiles fit ``smem_limit``; the smallest one if none does.

    Tiles that cannot fit (fp32, head 256) would fail only after a compile of many seconds
    each; dropping them first keeps an fp32 or large-head start from stalling in the tuner."""
    def need(c):
        return prefill_tile_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                                       c.num_stages, block_d, element_size)
    fitting = [c for c in configs if need(c) <= smem_limit]
    return fitting or [min(configs, key=need)]


def _prune_prefill_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    query = args["q_ptr"]
    limit = device_info_for(query.device).shared_memory_per_block_bytes
    if not limit:   # a build that does not report it: let the compiler reject what fails
        return configs
    return fitting_prefill_configs(configs, limit, args["BLOCK_D"], query.element_size())


_tuned_prefill_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
             for m, n, w, st in PREFILL_CONFIGS],
    prune_configs_by={"early_config_prune": _prune_prefill_configs},
    # tune_bucket: tiles that win on a 5-row canary lose on a 4096-row prefill, so the
    # problem's size class is part of the key (it is otherwise unused by the kernel).
    key=["HEAD_SIZE", "GROUP", "SLIDING_WINDOW", "USE_SOFT_CAP", "E4M3_BITS", "SINKS",
         "tune_bucket"],
    # Timings persist in Triton's cache dir, which the engine keys by device and versions
    # (engine/kernel_cache.py): a second start on the same machine does not tune again.
    cache_results=True,
)(_prefill_kernel)


# The largest max_query_len of each autotune size class but the last (which is unbounded).
TUNE_BUCKET_BOUNDS = (64, 1024)


def tune_bucket(max_query_len: int) -> int:
    """Size class of a prefill for autotuning (multiples of 16: one compiled variant)."""
    if max_query_len <= TUNE_BUCKET_BOUNDS[0]:
        return 16
    return 256 if max_query_len <= TUNE_BUCKET_BOUNDS[1] else 4096


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
                      *, num_seqs: int, max_query_len: int, scale: float,
                      sliding_window: int | None = None, soft_cap: float | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      tiles: tuple[int, int, int, int] | None = None,
                      e4m3_bits: bool | None = None, flat_grid: bool = False,
                      sinks: torch.Tensor | None = None,
                      key_window: tuple[int, int] | None = None,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context; writes ``out``.

    On a GPU the tiles are autotuned once per head size, group, dtype and feature set
    (16-bit dtypes on tensor cores; fp32 and GPUs below SM80 take ``_prefill_tiles``); ``tiles`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) pins them (tests, tuning).
    ``flat_grid``: one axis of query tiles over all sequences (tokens / BLOCK_M + sequences
    programs) instead of max_query_len / BLOCK_M per sequence, for batches padded to a
    captured bucket, where most sequence slots are empty. ``sinks`` [H]: each query head's
    attention sink logit (AttentionLayerParams.sinks). ``key_window`` (lo, hi): only the keys
    at positions lo <= p < hi of each sequence are read and attended (the block tables need
    map only those); a row that sees none gets zeros. ``lse`` [T, H] float32: receives each
    row's natural-log softmax denominator (-inf where it saw no key), to merge windows.
    """
    _, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_seqs == 0 or max_query_len == 0:
        return out
    kv_cache, bits = cache_operand(kv_cache, e4m3_bits)
    if bits:
        k_scale, v_scale = k_scale * E4M3_BITS_SCALE, v_scale * E4M3_BITS_SCALE
    args = (query, kv_cache, block_tables, seq_lens, query_start_loc, out,
            sinks if sinks is not None else seq_lens, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            block_tables.stride(0), scale * k_scale, v_scale, soft_cap or 1.0,
            tune_bucket(max_query_len), num_seqs,
            lse if lse is not None else seq_lens, lse.stride(0) if lse is not None else 0,
            *(key_window or (0, 0)))
    constants = dict(
        GROUP=num_heads // num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_size), SLIDING_WINDOW=sliding_window or 0,
        USE_SOFT_CAP=soft_cap is not None and soft_cap > 0,
        DOT_PRECISION=dot_precision(query.dtype), E4M3_BITS=bits, FLAT_GRID=flat_grid,
        SINKS=sinks is not None)
    # Passed only when set: the autotuner keys on neither (a window runs the tiles tuned for
    # the whole context), and today's launches keep their compiled variants.
    if key_window is not None:
        constants["KEY_WINDOW"] = True
    if lse is not None:
        constants["WRITE_LSE"] = True
    num_tokens = query.shape[0]

    def programs(block_m: int) -> tuple[int, ...]:
        if flat_grid:
            return triton.cdiv(num_tokens, block_m) + num_seqs, num_heads
        return triton.cdiv(max_query_len, block_m), num_seqs, num_heads

    # Products on FMA units are not autotuned (fp32's ieee tl.dot; any below SM80): the
    # small tile does not spill, while every candidate compiles for many seconds (a Gemma-3
    # start in fp32 spent minutes tuning its sliding and global layers on an H200).
    if tiles is None:
        device = device_info_for(query.device)
        if (not triton_interpreted() and query.dtype != torch.float32
                and dot_has_tensor_cores(device)):
            _tuned_prefill_kernel[lambda meta: programs(meta["BLOCK_M"])](*args, **constants)
            return out
        tiles = _prefill_tiles(head_size, query.dtype, device)
    block_m, block_n, num_warps, num_stages = tiles
    _prefill_kernel[programs(block_m)](*args, **constants, BLOCK_M=block_m, BLOCK_N=block_n,
                                       num_warps=num_warps, num_stages=num_stages)
    return out
