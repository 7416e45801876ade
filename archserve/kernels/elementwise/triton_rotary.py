"""Neox-style rotary embedding for q and k in one Triton kernel.

One program per token: it gathers that token's cos/sin row once and rotates every q head
and every k head with it. Heads are [H, D/2] tiles, so a token is a handful of wide
loads rather than a program per head. Numerics follow ``rotary_reference`` step by step:
cos and sin are rounded to the activations' dtype, and so is each product and each sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype


@triton.jit
def rotate_halves(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) of fp32 halves, in fp32 holding DTYPE values.

    Each product is rounded before the sum, as the reference's (and HF's) separate
    multiplies in the activations' dtype do: bf16/fp16 results then agree bit for bit.
    """
    x1_cos, x2_sin = round_to_dtype(x1 * cos, DTYPE), round_to_dtype(x2 * sin, DTYPE)
    x2_cos, x1_sin = round_to_dtype(x2 * cos, DTYPE), round_to_dtype(x1 * sin, DTYPE)
    return round_to_dtype(x1_cos - x2_sin, DTYPE), round_to_dtype(x2_cos + x1_sin, DTYPE)


@triton.jit
def rotary_cos_sin(positions_ptr, positions_stride, token, cos_ptr, sin_ptr, cache_stride,
                   cols, col_mask, DTYPE: tl.constexpr):
    """One token's cos and sin rows [1, HALF_BLOCK], rounded to DTYPE (as the reference
    casts the cache to the activations' dtype). The positions are read where they lie,
    strided or not: the q/k-norm-rope-cache kernel reads them before PDL's wait, where a
    copy made by its wrapper would be the kernel launched right before."""
    position = tl.load(positions_ptr + token * positions_stride).to(tl.int64)
    cos = tl.load(cos_ptr + position * cache_stride + cols, mask=col_mask, other=0.0)
    sin = tl.load(sin_ptr + position * cache_stride + cols, mask=col_mask, other=0.0)
    return (round_to_dtype(cos.to(tl.float32), DTYPE),
            round_to_dtype(sin.to(tl.float32), DTYPE))


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, cos, sin, NUM_HEADS: tl.constexpr,
                  HEAD_SIZE: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                  HALF_BLOCK: tl.constexpr):
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (heads < NUM_HEADS) & (cols < half)
    first = heads * HEAD_SIZE + cols
    x1 = tl.load(src_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + first + half, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = dst_ptr.dtype.element_ty
    out1, out2 = rotate_halves(x1, x2, cos, sin, dtype)
    tl.store(dst_ptr + first, out1.to(dtype), mask=mask)
    tl.store(dst_ptr + first + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                   positions_stride, q_stride, k_stride, q_out_stride, k_out_stride,
                   cache_stride,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   HEAD_SIZE: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr,
                   K_HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    col_mask = cols < HEAD_SIZE // 2
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    cos, sin = rotary_cos_sin(positions_ptr, positions_stride, token, cos_ptr, sin_ptr,
                              cache_stride, cols, col_mask, dtype)
    _rotate_heads(q_ptr + token * q_stride, q_out_ptr + token * q_out_stride, cos, sin,
                  NUM_Q_HEADS, HEAD_SIZE, Q_HEADS_BLOCK, HALF_BLOCK)
    _rotate_heads(k_ptr + token * k_stride, k_out_ptr + token * k_out_stride, cos, sin,
                  NUM_K_HEADS, HEAD_SIZE, K_HEADS_BLOCK, HALF_BLOCK)


def _rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor, inplace: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rotary_reference``; ``inplace`` rotates q and k in their storage.

    q [T, Hq*D] and k [T, Hkv*D] may be row-strided views (slices of a fused qkv output);
    out-of-place results are contiguous. In place needs unit stride along each row.
    """
    head_size = 2 * cos_sin_width(cos_cache, sin_cache)
    num_tokens = q.shape[0]
    if inplace:
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            raise ValueError("in-place rotary needs q and k with unit stride along a row")
        q_in, k_in, q_out, k_out = q, k, q, k
    else:
        q_in, k_in = _rows_with_unit_stride(q), _rows_with_unit_stride(k)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    num_q_heads, num_k_heads = q.shape[1] // head_size, k.shape[1] // head_size
    q_heads_block = triton.next_power_of_2(num_q_heads)
    k_heads_block = triton.next_power_of_2(num_k_heads)
    half_block = triton.next_power_of_2(head_size // 2)
    tile = max(q_heads_block, k_heads_block) * half_block
    _rotary_kernel[(num_tokens,)](
        positions, q_in, k_in, q_out, k_out, cos_cache, sin_cache, positions.stride(0),
        q_in.stride(0), k_in.stride(0), q_out.stride(0), k_out.stride(0), cos_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_SIZE=head_size,
        Q_HEADS_BLOCK=q_heads_block, K_HEADS_BLOCK=k_heads_block, HALF_BLOCK=half_block,
        num_warps=min(max(tile // 256, 1), 8))
    return q_out, k_out


def cos_sin_width(cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> int:
    """D/2 of [max_pos, D/2] caches that share one layout (the kernel indexes both alike)."""
    if cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride() \
            or cos_cache.stride(-1) != 1:
        raise ValueError("cos and sin caches must be [max_pos, D/2] with the same layout")
    return cos_cache.shape[-1]
