"""The attention preamble in one Triton kernel: per-head q/k RMSNorm (Qwen3; skipped for
Llama), neox rotary on q and k, and the paged KV-cache write of k and v.

Unfused, a decoder layer launches four kernels between its QKV GEMM and its attention (q
norm, k norm, rotary, cache write), each moving a few KB at batch 1: launch latency, not
bandwidth, sets their time. Here one launch reads the fused qkv output once, writes the
rotated q for the attention kernel and stores k and v straight into the cache, so the
attention backend is called with nothing left to write: a program per block of a token's
query heads, and one for its keys and values.

Numerics are the unfused path's, step by step: the norm through ``scale_normalized`` (as
``triton_rms_norm``), the rotation through ``rotate_halves`` (as ``triton_rotary``). A
16-bit cache only: an fp8 cache keeps the unfused path and its byte-mode writers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rms_norm import scale_normalized
from archserve.kernels.elementwise.triton_rotary import rotary_cos_sin, rotate_halves
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

# Query heads a program normalises and rotates (a power of two; the keys and values take
# one more program a token). At batch 1 one program for the whole token spent ~2 µs of a
# decode layer on one SM's instruction issue (norms, rotations and roundings of 36 heads):
# in blocks of 4 it is one load's latency, a few heads' arithmetic and a store (H200 chain,
# Qwen3-30B-A3B: 2.43 -> 1.15 µs a launch; blocks of 2 and 8 within 0.02 of 4).
Q_HEADS_PER_PROGRAM = 4


@triton.jit
def _norm_weight_halves(weight_ptr, cols, col_mask, HEAD_SIZE: tl.constexpr,
                        HAS_NORM: tl.constexpr):
    """The fp32 halves of a q/k norm weight (zeros without HAS_NORM: unused)."""
    if HAS_NORM:
        w1 = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HEAD_SIZE // 2 + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w1 = tl.zeros(cols.shape, tl.float32)
        w2 = w1
    return w1, w2


@triton.jit
def _norm_and_rotate(x1, x2, w1, w2, cos, sin, eps, HEAD_SIZE: tl.constexpr,
                     HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """[heads, D/2] halves of each head -> rotated (normalised first by the weight's halves
    ``w1``, ``w2``, with HAS_NORM)."""
    if HAS_NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] / HEAD_SIZE
        inv_rms = tl.math.rsqrt(mean_square + eps)
        x1 = scale_normalized(x1, inv_rms, w1, DTYPE, DTYPE, False)
        x2 = scale_normalized(x2, inv_rms, w2, DTYPE, DTYPE, False)
    return rotate_halves(x1, x2, cos, sin, DTYPE)


@triton.jit
def _qk_norm_rope_cache_kernel(
        qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr,
        cache_ptr, slot_mapping_ptr, positions_stride, qkv_stride, q_out_stride, cos_stride,
        stride_cache_kv, stride_cache_block, stride_cache_token, stride_cache_head, eps,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr,
        HALF_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr = False):
    # A program per (token, block of heads): blocks 0.. take Q_HEADS_BLOCK query heads each,
    # the last one the token's keys and values (Q_HEADS_PER_PROGRAM says why).
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.num_programs(1) - 1
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_SIZE // 2
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    col_mask = cols < half
    # Before PDL's wait (kernels/pdl.py): what the kernel before (the QKV GEMM) does not
    # write. The positions and slots are the step's inputs, the rotary tables and the norm
    # weights constants; the position -> cos/sin chain is two dependent reads, now off the
    # path that starts when that kernel ends.
    cos, sin = rotary_cos_sin(positions_ptr, positions_stride, token, cos_ptr, sin_ptr,
                              cos_stride, cols, col_mask, dtype)
    row = qkv_ptr + token * qkv_stride
    if block < q_blocks:
        w1, w2 = _norm_weight_halves(q_weight_ptr, cols, col_mask, HEAD_SIZE, HAS_NORM)
        pdl_start(PDL)
        heads = block * Q_HEADS_BLOCK + tl.arange(0, Q_HEADS_BLOCK)[:, None]
        q_mask = (heads < NUM_Q_HEADS) & col_mask
        q_first = heads * HEAD_SIZE + cols
        q1 = tl.load(row + q_first, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(row + q_first + half, mask=q_mask, other=0.0).to(tl.float32)
        q1, q2 = _norm_and_rotate(q1, q2, w1, w2, cos, sin, eps, HEAD_SIZE, HAS_NORM, dtype)
        q_dst = q_out_ptr + token * q_out_stride + q_first
        tl.store(q_dst, q1.to(dtype), mask=q_mask)
        tl.store(q_dst + half, q2.to(dtype), mask=q_mask)
    else:
        w1, w2 = _norm_weight_halves(k_weight_ptr, cols, col_mask, HEAD_SIZE, HAS_NORM)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        pdl_start(PDL)
        kv_heads = tl.arange(0, KV_HEADS_BLOCK)[:, None]
        kv_first = kv_heads * HEAD_SIZE + cols
        k_row = row + NUM_Q_HEADS * HEAD_SIZE
        v_row = k_row + NUM_KV_HEADS * HEAD_SIZE
        kv_mask = (kv_heads < NUM_KV_HEADS) & col_mask
        # Every load before the first store (a load written after a store waits for it:
        # the compiler cannot tell the pointers apart).
        k1 = tl.load(k_row + kv_first, mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + kv_first + half, mask=kv_mask, other=0.0).to(tl.float32)
        v1 = tl.load(v_row + kv_first, mask=kv_mask, other=0.0)
        v2 = tl.load(v_row + kv_first + half, mask=kv_mask, other=0.0)
        k1, k2 = _norm_and_rotate(k1, k2, w1, w2, cos, sin, eps, HEAD_SIZE, HAS_NORM, dtype)
        # Slot -1 marks padding (a graph batch larger than the real one): masked, not
        # skipped, as the cache writer does; the slot is broadcast first (the interpreter
        # mistypes scalar-bool & tensor).
        write = kv_mask & ((tl.zeros([KV_HEADS_BLOCK, HALF_BLOCK], tl.int64) + slot) >= 0)
        element = cache_ptr.dtype.element_ty
        k_dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block
                 + (slot % BLOCK_SIZE) * stride_cache_token + kv_heads * stride_cache_head
                 + cols)
        tl.store(k_dst, k1.to(element), mask=write)
        tl.store(k_dst + half, k2.to(element), mask=write)
        tl.store(k_dst + stride_cache_kv, v1.to(element), mask=write)
        tl.store(k_dst + stride_cache_kv + half, v2.to(element), mask=write)


def qk_norm_rope_cache_unsupported(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                                   head_size: int, cos_cache: torch.Tensor,
                                   norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
                                   kv_cache: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take these operands (the unfused path then runs), or None."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        return f"qkv {tuple(qkv.shape)} is not a row-major [T, {width}] tensor"
    if head_size % 2 or 2 * cos_cache.shape[-1] != head_size:
        return f"rotary over {2 * cos_cache.shape[-1]} of head size {head_size} (partial)"
    if kv_cache.dtype != qkv.dtype:
        return f"KV cache {kv_cache.dtype} with activations {qkv.dtype} (fp8 cache writers)"
    if kv_cache.dim() != 5 or kv_cache.shape[3:] != (num_kv_heads, head_size) \
            or kv_cache.stride(-1) != 1:
        return f"KV cache of shape {tuple(kv_cache.shape)}"
    if norm_weights is not None and any(w.dtype != qkv.dtype or w.shape != (head_size,)
                                        or w.stride(0) != 1 for w in norm_weights):
        return "q/k norm weights of another dtype, size or stride than the heads"
    return None


def qk_norm_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                       sin_cache: torch.Tensor,
                       norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                       num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) D] -> rotated q [T, H D]; k (normed, rotated) and v written into
    ``kv_cache`` at ``slot_mapping`` (slot -1 skipped). ``norm_weights``: (q_norm, k_norm)
    weights [D], or None (no per-head norm). The caller checks
    ``qk_norm_rope_cache_unsupported`` first."""
    head_size = 2 * cos_cache.shape[-1]
    num_tokens = qkv.shape[0]
    q = torch.empty((num_tokens, num_heads * head_size), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    q_weight, k_weight = norm_weights if norm_weights is not None else (cos_cache, cos_cache)
    heads_block = min(triton.next_power_of_2(num_heads), Q_HEADS_PER_PROGRAM)
    kv_block = triton.next_power_of_2(num_kv_heads)
    half_block = triton.next_power_of_2(head_size // 2)
    pdl = pdl_enabled(qkv.device)
    _qk_norm_rope_cache_kernel[(num_tokens, triton.cdiv(num_heads, heads_block) + 1)](
        qkv, positions, cos_cache, sin_cache, q_weight, k_weight, q, kv_cache, slot_mapping,
        positions.stride(0), qkv.stride(0), q.stride(0), cos_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        float(eps),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2], Q_HEADS_BLOCK=heads_block, KV_HEADS_BLOCK=kv_block,
        HALF_BLOCK=half_block, HAS_NORM=norm_weights is not None, PDL=pdl,
        num_warps=min(max(max(heads_block, kv_block) * half_block // 256, 1), 8),
        **pdl_launch_options(pdl))
    return q
