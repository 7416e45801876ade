"""DeepSeek V4's hyper-connections in Triton (the reference: hyper_connection_reference.py).

Before a block, per token:

1. the perceptron's logits: the flattened streams (n x H values) against the mixing
   matrix fn [(2 + n) n, n H] (fp32), with their sum of squares (the RMS normalisation is
   a scale on the row, applied after the dot products). A step of few tokens splits the
   n H columns over many programs (``_hc_partial_kernel``: a token's 1.5 MiB of fn at V4's
   sizes would keep one program busy for tens of µs); a long prompt takes torch's fp32
   matmul (cuBLAS: fn once from memory for the whole step);
2. ``_hc_finalize_kernel``: the weights (pre: sigmoid, post: 2 sigmoid, comb: softmax rows
   then Sinkhorn-Knopp), the collapse sum_i pre_i x_i rounded to the model dtype, and the
   block's RMSNorm of it (the norm's numerics as the RMSNorm kernel's): the block's input.
   The final collapse before the model's last norm (the hyper head) is the same kernel with
   pre weights only.

After a block, ``_hc_post_kernel``: stream i = post_i * out + sum_j comb[j, i] x_j, the
weights rounded to the model dtype first (as transformers computes it), sums in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rms_norm import scale_normalized

# Tokens up to which the logits are split-K GEMV programs (beyond: one fp32 matmul).
MAX_SPLIT_TOKENS = 16
SPLIT_PROGRAMS = 128          # programs a split step aims at over its tokens
BLOCK_K = 256


@triton.jit
def _hc_partial_kernel(x_ptr, fn_ptr, partial_ptr, stride_x, stride_fn, stride_p_token,
                       K: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    mask_m = rows < M
    dots = tl.zeros([BLOCK_M], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(split * CHUNK, (split + 1) * CHUNK, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask_k = cols < K
        x = tl.load(x_ptr + token * stride_x + cols, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + rows[:, None] * stride_fn + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        dots += tl.sum(w * x[None, :], axis=1)
        squares += x * x
    out = partial_ptr + token * stride_p_token + split * (BLOCK_M + 1)
    tl.store(out + rows, dots)          # the padding rows' are 0
    tl.store(out + BLOCK_M, tl.sum(squares, axis=0))


@triton.jit
def _hc_finalize_kernel(x_ptr, partial_ptr, base_ptr, scale_ptr, norm_ptr, out_ptr,
                        post_ptr, comb_ptr, stride_x, stride_p_token, stride_out,
                        norm_eps, hc_eps, block_eps,
                        N: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                        ITERS: tl.constexpr, HEAD: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    K: tl.constexpr = N * H
    # The logits: the splits' dot products summed, times 1/rms of the flattened streams.
    parts = partial_ptr + token * stride_p_token + tl.arange(0, SPLITS)[:, None] * (BLOCK_M + 1)
    lane = tl.arange(0, BLOCK_M)
    dots = tl.sum(tl.load(parts + lane[None, :]), axis=0)
    squares = tl.sum(tl.load(parts + BLOCK_M), axis=0)
    mixes = dots * tl.rsqrt(squares / K + norm_eps)
    i = tl.arange(0, BLOCK_N)
    mask_n = i < N
    pre_logit = tl.sum(tl.where(lane[None, :] == i[:, None], mixes[None, :], 0.0), axis=1)
    scale0 = tl.load(scale_ptr)
    pre = tl.sigmoid(pre_logit * scale0 + tl.load(base_ptr + i, mask=mask_n, other=0.0)) + hc_eps
    if not HEAD:
        scale1 = tl.load(scale_ptr + 1)
        scale2 = tl.load(scale_ptr + 2)
        post_logit = tl.sum(tl.where(lane[None, :] == N + i[:, None], mixes[None, :], 0.0),
                            axis=1)
        post = 2.0 * tl.sigmoid(post_logit * scale1
                                + tl.load(base_ptr + N + i, mask=mask_n, other=0.0))
        tl.store(post_ptr + token * N + i, post, mask=mask_n)
        # comb [N, N]: row r, column c at logit 2N + r N + c.
        cell = i[:, None] * N + i[None, :]
        mask_nn = mask_n[:, None] & mask_n[None, :]
        flat = 2 * N + cell
        comb = tl.zeros([BLOCK_N, BLOCK_N], tl.float32)
        for m in tl.static_range(BLOCK_M):
            value = tl.sum(tl.where(lane == m, mixes, 0.0), axis=0)
            comb = tl.where(flat == m, value, comb)
        comb = comb * scale2 + tl.load(base_ptr + flat, mask=mask_nn, other=0.0)
        comb = tl.where(mask_nn, comb, float("-inf"))
        comb = tl.exp(comb - tl.max(comb, axis=1)[:, None])
        comb = comb / tl.sum(comb, axis=1)[:, None] + hc_eps
        comb = tl.where(mask_nn, comb, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + token * N * N + cell, comb, mask=mask_nn)
    # The collapse, rounded to the model dtype, then the block's RMSNorm.
    cols = tl.arange(0, BLOCK_H)
    mask_h = cols < H
    xs = tl.load(x_ptr + token * stride_x + i[:, None] * H + cols[None, :],
                 mask=mask_n[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    y = tl.sum(tl.where(mask_n, pre, 0.0)[:, None] * xs, axis=0).to(dtype).to(tl.float32)
    if HAS_NORM:
        w = tl.load(norm_ptr + cols, mask=mask_h, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(y * y, axis=0) / H + block_eps)
        y = scale_normalized(y, inv_rms, w, dtype, out_ptr.dtype.element_ty, False)
    tl.store(out_ptr + token * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def _hc_post_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, stride_x, stride_out,
                    N: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = cols < H
    i = tl.arange(0, BLOCK_N)
    mask_n = i < N
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    mask = mask_n[:, None] & mask_h[None, :]
    xs = tl.load(x_ptr + token * stride_x + i[:, None] * H + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    out = tl.load(out_ptr + token * stride_out + cols, mask=mask_h, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + token * N + i, mask=mask_n, other=0.0).to(dtype).to(tl.float32)
    # combT[i, j] = comb[j, i]
    comb_t = tl.load(comb_ptr + token * N * N + i[None, :] * N + i[:, None],
                     mask=mask_n[:, None] & mask_n[None, :], other=0.0).to(dtype).to(tl.float32)
    mixed = tl.sum(comb_t[:, :, None] * xs[None, :, :], axis=1)
    new = post[:, None] * out[None, :] + mixed
    tl.store(new_ptr + token * stride_x + i[:, None] * H + cols[None, :], new.to(dtype),
             mask=mask)


def _logit_partials(x: torch.Tensor, fn: torch.Tensor, norm_eps: float
                    ) -> tuple[torch.Tensor, int, int]:
    """(partials [T, splits, BLOCK_M + 1]: each split's dot products then its sum of
    squares, splits, BLOCK_M)."""
    tokens, n, h = x.shape
    m, k = fn.shape
    block_m = triton.next_power_of_2(m)
    flat = x.reshape(tokens, k)
    if tokens > MAX_SPLIT_TOKENS:      # one matmul reads fn once for the whole step
        wide = flat.float()
        partials = torch.zeros(tokens, 1, block_m + 1, dtype=torch.float32, device=x.device)
        partials[:, 0, :m] = wide @ fn.float().t()
        partials[:, 0, block_m] = wide.square().sum(dim=1)
        return partials, 1, block_m
    splits = triton.next_power_of_2(max(1, min(k // BLOCK_K,
                                               triton.cdiv(SPLIT_PROGRAMS, tokens))))
    chunk = triton.cdiv(k, splits * BLOCK_K) * BLOCK_K
    partials = torch.empty(tokens, splits, block_m + 1, dtype=torch.float32, device=x.device)
    _hc_partial_kernel[(tokens, splits)](flat, fn, partials, flat.stride(0), fn.stride(0),
                                         partials.stride(0), K=k, M=m, BLOCK_M=block_m,
                                         CHUNK=chunk, BLOCK_K=BLOCK_K, num_warps=4)
    return partials, splits, block_m


def hc_pre_triton(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor,
                  block_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RMSNorm(collapse) [T, H] with ``norm_weight``, post [T, n], comb [T, n, n])."""
    tokens, n, h = x.shape
    x = x.contiguous()
    out = torch.empty(tokens, h, dtype=x.dtype, device=x.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out, post, comb
    partials, splits, block_m = _logit_partials(x, fn, norm_eps)
    _hc_finalize_kernel[(tokens,)](
        x, partials, base, scale, norm_weight, out, post, comb, x.stride(0),
        partials.stride(0), out.stride(0), norm_eps, hc_eps, block_eps, N=n, H=h,
        BLOCK_N=triton.next_power_of_2(max(n, 2)), BLOCK_H=triton.next_power_of_2(h),
        BLOCK_M=block_m, SPLITS=splits, ITERS=iters, HEAD=False, HAS_NORM=True,
        num_warps=8)
    return out, post, comb


def hc_head_triton(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   norm_eps: float, hc_eps: float, norm_weight: torch.Tensor, block_eps: float
                   ) -> torch.Tensor:
    """The final collapse, then the model's RMSNorm with ``norm_weight``: [T, H]."""
    tokens, n, h = x.shape
    x = x.contiguous()
    out = torch.empty(tokens, h, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    partials, splits, block_m = _logit_partials(x, fn, norm_eps)
    _hc_finalize_kernel[(tokens,)](
        x, partials, base, scale, norm_weight, out, out, out, x.stride(0), partials.stride(0),
        out.stride(0), norm_eps, hc_eps, block_eps, N=n, H=h,
        BLOCK_N=triton.next_power_of_2(max(n, 2)), BLOCK_H=triton.next_power_of_2(h),
        BLOCK_M=block_m, SPLITS=splits, ITERS=1, HEAD=True, HAS_NORM=True, num_warps=8)
    return out


def hc_post_triton(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                   ) -> torch.Tensor:
    tokens, n, h = x.shape
    x = x.contiguous()
    new = torch.empty_like(x)
    if tokens == 0:
        return new
    block_h = min(triton.next_power_of_2(h), 512)
    _hc_post_kernel[(tokens, triton.cdiv(h, block_h))](
        x, out, post, comb, new, x.stride(0), out.stride(0), N=n, H=h,
        BLOCK_N=triton.next_power_of_2(max(n, 2)), BLOCK_H=block_h, num_warps=4)
    return new
