"""DeepSeek V4's per-head transform in Triton (the reference: reference.py's
``norm_rope_interleaved_reference``): an optional RMSNorm over each head's channels (with the
layer's weight, or unweighted), then rope on the head's trailing channels as interleaved
pairs, at its token's position (or back from it). One program a head row; the angles are
computed from inv_freq, not read from a table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rms_norm import scale_normalized


@triton.jit
def rope_tail_interleaved(x, inv_freq_ptr, position, WIDTH: tl.constexpr,
                          BLOCK_W: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """x [BLOCK_W] (fp32, WIDTH channels) with its trailing ROPE channels rotated as
    interleaved pairs at ``position`` (back from it where INVERSE); the angles are computed
    from inv_freq [ROPE // 2], not read from a table. DeepSeek V4 rotates the tail of
    every head this way: its queries and keys, and its compressor's entries and index keys."""
    even, odd = tl.split(tl.reshape(x, [BLOCK_W // 2, 2]))
    half = tl.arange(0, BLOCK_W // 2)
    first = (WIDTH - ROPE) // 2
    rotated = (half >= first) & (half < WIDTH // 2)
    freq = tl.load(inv_freq_ptr + half - first, mask=rotated, other=0.0)
    angle = position.to(tl.float32) * freq
    c = tl.cos(angle)
    s = tl.sin(angle)
    if INVERSE:
        s = -s
    new_even = tl.where(rotated, even * c - odd * s, even)
    new_odd = tl.where(rotated, odd * c + even * s, odd)
    return tl.reshape(tl.join(new_even, new_odd), [BLOCK_W])


@triton.jit
def _norm_rope_kernel(x_ptr, out_ptr, positions_ptr, inv_freq_ptr, weight_ptr, eps,
                      stride_token, stride_head, HEADS: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                      WEIGHTED: tl.constexpr, INVERSE: tl.constexpr):
    row = tl.program_id(0)
    token = row // HEADS
    head = row % HEADS
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    src = x_ptr + token.to(tl.int64) * stride_token + head * stride_head
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        if WEIGHTED:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x = scale_normalized(x, inv_rms, w, dtype, dtype, False).to(tl.float32)
        else:    # x times 1/rms rounded to x's dtype, the product rounded
            x = (x * inv_rms.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y = rope_tail_interleaved(x, inv_freq_ptr, tl.load(positions_ptr + token), D, BLOCK_D,
                              ROPE, INVERSE)
    dst = out_ptr + token.to(tl.int64) * (HEADS * D) + head * D
    tl.store(dst + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def norm_rope_interleaved_triton(x: torch.Tensor, positions: torch.Tensor,
                                 inv_freq: torch.Tensor, weight: torch.Tensor | None,
                                 eps: float | None, inverse: bool) -> torch.Tensor:
    """x [T, D] or [T, H, D] (rows strided, channels dense) -> a new contiguous tensor."""
    heads = x.shape[1] if x.dim() == 3 else 1
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens = x.shape[0]
    if tokens == 0:
        return out
    _norm_rope_kernel[(tokens * heads,)](
        x, out, positions, inv_freq, weight if weight is not None else inv_freq,
        eps or 0.0, x.stride(0), x.stride(1) if x.dim() == 3 else 0, HEADS=heads, D=d,
        BLOCK_D=triton.next_power_of_2(d), ROPE=2 * inv_freq.shape[0], NORM=eps is not None,
        WEIGHTED=weight is not None, INVERSE=inverse, num_warps=4 if d >= 256 else 1)
    return out
