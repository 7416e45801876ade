"""MLA decode's output to the heads' values in one Triton kernel: the split merge and W_UV.

MLA decode attends over the latent and leaves, per query head, an output over the latent
[T, H, L] (or, split, a partial output and log-sum-exp per split). The layer needs per-head
values [T, H, v] = out . W_UV[head]ᵀ for o_proj. Unfused that is the split merge kernel,
then a cuBLAS batched GEMM whose output is strided per head (o_proj then copies it): three
launches a layer at batch 1. Here one kernel merges the splits of a block of 16 sequences
of one head in registers, rounds the merged output to the activations' dtype (as the merge
kernel's store would), and multiplies it by a block of W_UV's rows with a ``tl.dot``: W_UV
is read once per block of sequences, and the values land in [T, H, v] rows o_proj reads
as they are.

The merge is ``_merge_splits_kernel``'s arithmetic (the largest log-sum-exp subtracted, empty
splits weigh 0, the sum scaled by ``v_scale`` before the store's rounding). With one split
the decode kernel wrote the final output itself, and this kernel only projects it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_decode import dot_precision
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

BLOCK_S = 16     # sequences per program: tl.dot's smallest M
BLOCK_V = 32     # value channels per program


@triton.jit
def _merged_latent_output(src_ptr, lse_ptr, seqs, tokens, live, head, num_heads,
                          stride_src_token, stride_src_head, offs_l, v_scale,
                          KV_RANK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          DTYPE: tl.constexpr):
    """[BLOCK_S, BLOCK_L] fp32 holding DTYPE values: the latent output of ``head`` for
    sequences ``seqs`` (their query rows ``tokens``), merged over the splits."""
    mask = live[:, None] & (offs_l < KV_RANK)[None, :]
    if NUM_SPLITS == 1:
        src = (src_ptr + tokens.to(tl.int64)[:, None] * stride_src_token
               + head * stride_src_head + offs_l[None, :])
        return tl.load(src, mask=mask, other=0.0).to(tl.float32)
    rows0 = (seqs.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(lse_ptr + rows0[:, None] + tl.arange(0, NUM_SPLITS)[None, :],
                  mask=live[:, None], other=float("-inf"))
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros(seqs.shape, tl.float32)
    merged = tl.zeros(mask.shape, tl.float32)
    # A loop, not unrolled: one split's [BLOCK_S, BLOCK_L] partial in registers at a time.
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(lse_ptr + rows0 + split, mask=live, other=float("-inf"))
                         - lse_max)
        part = tl.load(src_ptr + (rows0 + split)[:, None] * KV_RANK + offs_l[None, :],
                       mask=mask, other=0.0)
        total += weight
        merged += weight[:, None] * part
    merged = merged / tl.where(total > 0.0, total, 1.0)[:, None] * v_scale
    return merged.to(DTYPE).to(tl.float32)


@triton.jit
def _latent_output_to_heads_kernel(
        src_ptr, lse_ptr, query_start_loc_ptr, w_uv_ptr, out_ptr, num_seqs, num_heads,
        stride_src_token, stride_src_head, stride_w_head, stride_w_v, stride_out_token,
        stride_out_head, v_scale,
        KV_RANK: tl.constexpr, V_HEAD: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    head = tl.program_id(0)
    v_block = tl.program_id(1)
    seq_block = tl.program_id(2)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    # W_UV's rows are a weight: read before PDL's wait (kernels/pdl.py), as [L, BLOCK_V].
    w = tl.load(w_uv_ptr + head * stride_w_head + offs_v[None, :] * stride_w_v
                + offs_l[:, None], mask=(offs_l < KV_RANK)[:, None] & (offs_v < V_HEAD)[None, :],
                other=0.0)
    seqs = seq_block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_batch = seqs < num_seqs
    # The query starts are the step's inputs: read before the wait too.
    tokens = tl.load(query_start_loc_ptr + seqs, mask=in_batch, other=0)
    live = in_batch & (tl.load(query_start_loc_ptr + seqs + 1, mask=in_batch, other=0)
                       > tokens)
    pdl_start(PDL)
    latent = _merged_latent_output(src_ptr, lse_ptr, seqs, tokens, live, head, num_heads,
                                   stride_src_token, stride_src_head, offs_l, v_scale,
                                   KV_RANK, NUM_SPLITS, dtype)
    values = tl.dot(latent.to(w.dtype), w, input_precision=DOT_PRECISION)
    dst = (out_ptr + tokens.to(tl.int64)[:, None] * stride_out_token + head * stride_out_head
           + offs_v[None, :])
    tl.store(dst, values.to(dtype), mask=live[:, None] & (offs_v < V_HEAD)[None, :])


def latent_output_to_heads_triton(latent_out: torch.Tensor, partial_lse: torch.Tensor,
                                  query_start_loc: torch.Tensor, num_seqs: int,
                                  num_tokens: int, w_uv: torch.Tensor,
                                  v_scale: float = 1.0) -> torch.Tensor:
    """Per-head values [num_tokens, H, v] of MLA decode's output over the latent:
    ``latent_out`` is either the final output [num_tokens, H, L] (one split;
    ``partial_lse`` unused) or the split partials [num_seqs, H, S, L] with their
    log-sum-exps [num_seqs, H, S], merged here (``v_scale`` as ``merge_splits``). Row
    ``query_start_loc[i]`` is sequence i's; rows of no live sequence are left unwritten,
    as the merge leaves them. ``w_uv`` [H, v, L], contiguous along L."""
    num_heads, v_head, kv_rank = w_uv.shape
    split = latent_out.dim() == 4
    out = torch.empty((num_tokens, num_heads, v_head), dtype=w_uv.dtype, device=w_uv.device)
    if num_seqs == 0:
        return out
    pdl = pdl_enabled(out.device)
    grid = (num_heads, triton.cdiv(v_head, BLOCK_V), triton.cdiv(num_seqs, BLOCK_S))
    # 8 warps: at DeepSeek's latent (512) the merged [16, 512] fp32 tile and W_UV's [512, 32]
    # rows spill at 4 (ptxas for sm_90a: 52-472 bytes), not at 8.
    _latent_output_to_heads_kernel[grid](
        latent_out, partial_lse, query_start_loc, w_uv, out, num_seqs, num_heads,
        0 if split else latent_out.stride(0), 0 if split else latent_out.stride(1),
        w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1), float(v_scale),
        KV_RANK=kv_rank, V_HEAD=v_head, BLOCK_L=triton.next_power_of_2(kv_rank),
        BLOCK_S=BLOCK_S, BLOCK_V=BLOCK_V, NUM_SPLITS=latent_out.shape[2] if split else 1,
        DOT_PRECISION=dot_precision(w_uv.dtype), PDL=pdl, num_warps=8,
        **pdl_launch_options(pdl))
    return out
