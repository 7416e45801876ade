"""MLA decode's output to the heads' values in one Triton kernel: the split merge and W_UV.

MLA decode attends over the latent and leaves, per query head, an output over the latent
[T, H, L] (or, split, a partial output and log-sum-exp per split). The layer needs per-head
values [T, H, v] = out . W_UV[head]ᵀ for o_proj. Unfused that is the split merge kernel,
then a cuBLAS batched GEMM: two launches a layer. Here one kernel merges the splits of a
few sequences of one head in registers (as many as their partials fit: up to 16, the rows
of one ``tl.dot`` tile), rounds the merged output to the activations' dtype (as the merge
kernel's store would), and multiplies it by a block of W_UV's rows with a ``tl.dot``: the
values land in [T, H, v] rows o_proj reads as they are.

The merge is ``_merge_splits_kernel``'s arithmetic (the largest log-sum-exp subtracted, empty
splits weigh 0, the sum scaled by ``v_scale`` before the store's rounding). With one split
the decode kernel wrote the final output itself, and this kernel only projects it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_decode import active_splits
from archserve.kernels.pdl import (
    pdl_enabled,
    pdl_launch_options,
    pdl_start,
    prefetch_rows_to_l2,
)
from archserve.kernels.triton_dot import dot_precision

BLOCK_S = 16     # rows of a program's tile: tl.dot's smallest M
# Split partials a program holds in flight while merging: SEQS x NUM_SPLITS rows of the
# latent in fp32 (at 64, with 8 warps and DeepSeek's 512, ~128 registers a thread).
MERGE_ROWS_IN_FLIGHT = 64
BLOCK_V = 32     # value channels per program


@triton.jit
def _merged_row(src_ptr, lse_ptr, seq, num_seqs, active, head, num_heads, offs_l, v_scale,
                KV_RANK: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """fp32 [BLOCK_L]: ``head``'s latent output of sequence ``seq`` merged over its first
    ``active`` splits, times ``v_scale`` (zeros for a sequence past ``num_seqs``). Its
    splits are one [NUM_SPLITS, BLOCK_L] load."""
    splits = tl.arange(0, NUM_SPLITS)
    # As a vector (a mask must be one); a sequence with no query is masked at the store.
    in_batch = ((splits * 0 + seq) < num_seqs) & (splits < active)
    row0 = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(lse_ptr + row0 + splits, mask=in_batch, other=float("-inf"))
    parts = tl.load(src_ptr + (row0 + splits)[:, None] * KV_RANK + offs_l[None, :],
                    mask=in_batch[:, None] & (offs_l < KV_RANK)[None, :], other=0.0)
    # _merge_splits_kernel's arithmetic, step for step (the same rounding).
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    row = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    return row * v_scale


@triton.jit
def _merged_latent_output(src_ptr, lse_ptr, first_seq, num_seqs, tokens, live, num_active,
                          head, num_heads, stride_src_token, stride_src_head, offs_l, v_scale,
                          KV_RANK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, SEQS: tl.constexpr, DTYPE: tl.constexpr):
    """[BLOCK_S, BLOCK_L] fp32 holding DTYPE values: the latent output of ``head`` for the
    SEQS sequences from ``first_seq`` on (their query rows ``tokens``), merged over the
    splits that hold keys (``num_active`` [BLOCK_S], from ``active_splits``: the others
    stored nothing); rows past SEQS hold zeros."""
    l_ok = offs_l < KV_RANK
    if NUM_SPLITS == 1:
        src = (src_ptr + tokens.to(tl.int64)[:, None] * stride_src_token
               + head * stride_src_head + offs_l[None, :])
        return tl.load(src, mask=live[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
    # Sequence by sequence (_merged_row): unrolled, so the rows' loads are independent and
    # overlap. (A loop over the splits instead waited for one load per split in turn: ~10
    # µs a launch at batch 1 with 16 splits on an H200.) SEQS rows only: each holds
    # NUM_SPLITS x BLOCK_L fp32 values in flight.
    rows = tl.arange(0, BLOCK_S)
    merged = tl.zeros((BLOCK_S, offs_l.shape[0]), tl.float32)
    for r in tl.static_range(SEQS):
        # Row r's count of splits with keys, out of the vector computed before PDL's wait.
        active = tl.sum(tl.where(rows == r, num_active, 0), axis=0)
        row = _merged_row(src_ptr, lse_ptr, first_seq + r, num_seqs, active, head,
                          num_heads, offs_l, v_scale, KV_RANK, NUM_SPLITS)
        merged = tl.where(rows[:, None] == r, row[None, :], merged)
    return merged.to(DTYPE).to(tl.float32)


# num_seqs unspecialised: a mixed step's decode rows are any count, and the CUDA graphs'
# batch sizes (where the warm-up compiles) would not reach Triton's other specialisations.
@triton.jit(do_not_specialize=["num_seqs"])
def _latent_output_to_heads_kernel(
        src_ptr, lse_ptr, query_start_loc_ptr, seq_lens_ptr, w_uv_ptr, out_ptr, num_seqs,
        num_heads, stride_src_token, stride_src_head, stride_w_head, stride_w_v,
        stride_out_token, stride_out_head, v_scale,
        KV_RANK: tl.constexpr, V_HEAD: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLIT_BLOCK_N: tl.constexpr, SEQS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        ROW_PRODUCT: tl.constexpr = False, PDL: tl.constexpr = False):
    head = tl.program_id(0)
    v_block = tl.program_id(1)
    seq_block = tl.program_id(2)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    w_cols = w_uv_ptr + head * stride_w_head + offs_v * stride_w_v     # W_UV's rows, [BLOCK_V]
    w_ok = (offs_l < KV_RANK)[:, None] & (offs_v < V_HEAD)[None, :]
    if NUM_SPLITS == 1:
        # A weight: read before PDL's wait (kernels/pdl.py), as [L, BLOCK_V].
        w = tl.load(w_cols[None, :] + offs_l[:, None], mask=w_ok, other=0.0)
    else:
        # The merge needs the registers; the rows go to L2 before the wait instead.
        prefetch_rows_to_l2(w_cols, offs_v < V_HEAD, KV_RANK, BLOCK_L, PDL)
    # SEQS sequences a program; tl.dot's 16 rows are the tile, the rows past SEQS masked.
    lanes = tl.arange(0, BLOCK_S)
    seqs = seq_block * SEQS + lanes
    in_batch = (lanes < SEQS) & (seqs < num_seqs)
    # The query starts are the step's inputs: read before the wait too.
    tokens = tl.load(query_start_loc_ptr + seqs, mask=in_batch, other=0)
    live = in_batch & (tl.load(query_start_loc_ptr + seqs + 1, mask=in_batch, other=0)
                       > tokens)
    num_active = lanes * 0
    if NUM_SPLITS > 1:   # which splits hold keys (SPLIT_BLOCK_N: the decode kernel's tile)
        num_active = tl.where(live, active_splits(query_start_loc_ptr, seq_lens_ptr,
                                                  tl.where(in_batch, seqs, 0), 0, NUM_SPLITS,
                                                  SPLIT_BLOCK_N), 0)
    pdl_start(PDL)
    if ROW_PRODUCT:
        # One sequence (SEQS 1, split): its merged row times W_UV's block on the CUDA
        # cores, [L, BLOCK_V] summed over L, without tl.dot's 16-row tile (H200, V2-Lite's
        # batch 1 in a chain of launches: 2.63 µs a launch against 3.32).
        active = tl.sum(tl.where(lanes == 0, num_active, 0), axis=0)
        row = _merged_row(src_ptr, lse_ptr, seq_block, num_seqs, active, head, num_heads,
                          offs_l, v_scale, KV_RANK, NUM_SPLITS)
        w = tl.load(w_cols[None, :] + offs_l[:, None], mask=w_ok, other=0.0)
        row = row.to(dtype).to(tl.float32)
        values = tl.sum(row[:, None] * w.to(tl.float32), axis=0)[None, :]
    else:
        latent = _merged_latent_output(src_ptr, lse_ptr, seq_block * SEQS, num_seqs, tokens,
                                       live, num_active, head, num_heads, stride_src_token,
                                       stride_src_head, offs_l, v_scale, KV_RANK, NUM_SPLITS,
                                       BLOCK_S, SEQS, dtype)
        if NUM_SPLITS > 1:
            w = tl.load(w_cols[None, :] + offs_l[:, None], mask=w_ok, other=0.0)
        values = tl.dot(latent.to(w.dtype), w, input_precision=DOT_PRECISION)
    dst = (out_ptr + tokens.to(tl.int64)[:, None] * stride_out_token + head * stride_out_head
           + offs_v[None, :])
    tl.store(dst, values.to(dtype), mask=live[:, None] & (offs_v < V_HEAD)[None, :])


def latent_output_to_heads_triton(latent_out: torch.Tensor, partial_lse: torch.Tensor,
                                  query_start_loc: torch.Tensor, num_seqs: int,
                                  num_tokens: int, w_uv: torch.Tensor,
                                  v_scale: float = 1.0, *, seq_lens: torch.Tensor | None = None,
                                  split_block_n: int | None = None) -> torch.Tensor:
    """Per-head values [num_tokens, H, v] of MLA decode's output over the latent:
    ``latent_out`` is either the final output [num_tokens, H, L] (one split;
    ``partial_lse`` unused) or the split partials [num_seqs, H, S, L] with their
    log-sum-exps [num_seqs, H, S], merged here (``v_scale``, ``seq_lens`` and
    ``split_block_n`` as ``merge_splits``: the splits that hold keys only). Row
    ``query_start_loc[i]`` is sequence i's; rows of no live sequence are left unwritten,
    as the merge leaves them. ``w_uv`` [H, v, L], contiguous along L."""
    num_heads, v_head, kv_rank = w_uv.shape
    split = latent_out.dim() == 4
    out = torch.empty((num_tokens, num_heads, v_head), dtype=w_uv.dtype, device=w_uv.device)
    if num_seqs == 0:
        return out
    if split and (seq_lens is None or split_block_n is None):
        raise ValueError("merging split partials needs the sequences' lengths and the "
                         "decode kernel's BLOCK_N (which splits hold keys)")
    pdl = pdl_enabled(out.device)
    num_splits = latent_out.shape[2] if split else 1
    # Unsplit: a tile of 16 sequences. Split: as many as the partials' registers allow, and
    # one for a batch of one (not a masked second row: H200 chain, V2-Lite's batch 1, 3.32
    # µs a launch against 4.19); only that count, so a mixed step's decode rows of any count
    # compile no other variant.
    seqs = (1 if split and num_seqs == 1
            else min(BLOCK_S, max(1, MERGE_ROWS_IN_FLIGHT // num_splits)))
    grid = (num_heads, triton.cdiv(v_head, BLOCK_V), triton.cdiv(num_seqs, seqs))
    # 8 warps: at DeepSeek's latent (512) the merged [16, 512] fp32 tile and W_UV's [512, 32]
    # rows spill at 4 (ptxas for sm_90a: 52-472 bytes), not at 8.
    _latent_output_to_heads_kernel[grid](
        latent_out, partial_lse, query_start_loc,
        seq_lens if seq_lens is not None else query_start_loc, w_uv, out, num_seqs, num_heads,
        0 if split else latent_out.stride(0), 0 if split else latent_out.stride(1),
        w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1), float(v_scale),
        KV_RANK=kv_rank, V_HEAD=v_head, BLOCK_L=triton.next_power_of_2(kv_rank),
        BLOCK_S=BLOCK_S, BLOCK_V=BLOCK_V, NUM_SPLITS=num_splits,
        SPLIT_BLOCK_N=split_block_n or 1, SEQS=seqs,
        DOT_PRECISION=dot_precision(w_uv.dtype), ROW_PRODUCT=split and seqs == 1, PDL=pdl,
        num_warps=8,
        **pdl_launch_options(pdl))
    return out
