"""The MLA decode step's inputs in one Triton kernel: the absorbed query and the latent write.

Between its two projections (q, and kv_a = [c_kv | k_pe]) and the MLA decode kernel, the
unfused layer launches about eight kernels per decode step: a copy of c_kv, its RMSNorm,
two de-interleaving concatenations, the rotary kernel, the latent's concatenation, the
cache write, and W_UK's batched GEMM with the concatenation of its output and q_pe (torch
kernels among them, which PDL cannot overlap). At batch 1 each moves a few KB and costs a
launch; on DeepSeek-V2-Lite they were ~0.4 ms of a 2.7 ms step (H200 profile, 27 layers).

Here one launch does it all. The grid is (row blocks, heads, latent blocks + 1):
- a program of latent block ``l`` computes q_nope . W_UK[head][:, l-block] for BLOCK_T rows
  (a ``tl.dot``: W_UK is read once per row block, not once per row);
- the last program of each head rotates that head's q_pe; the one of head 0 also normalises
  c_kv, rotates k_pe and writes the latent rows into the cache at their slots.
The absorbed query [T, H, L + R] is what ``mla_decode`` reads.

Numerics follow the unfused path step by step: the norm through ``scale_normalized`` (as
``triton_rms_norm``), the rotation through ``rotary_cos_sin`` and ``rotate_halves`` (as
``triton_rotary``), the rotated halves stored de-interleaved (DeepSeek's interleaved rope
pairs: evens, then odds, as ``MLAAttention`` de-interleaves them), and W_UK's product
accumulated in fp32 and rounded once (exact fp32 products for an fp32 model). A 16-bit or
fp32 cache of the activations' dtype only: an fp8 latent keeps the unfused path and its
byte-mode writers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rms_norm import scale_normalized
from archserve.kernels.elementwise.triton_rotary import rotary_cos_sin, rotate_halves
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from archserve.kernels.triton_dot import dot_precision

BLOCK_T = 16          # rows per program: tl.dot's smallest M
BLOCK_L = 64          # latent values per absorbing program


@triton.jit
def _rope_halves_offsets(half_cols, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Offsets of the two halves rotate_halves pairs: (evens, odds) of interleaved pairs, or
    the first and second half."""
    if INTERLEAVED:
        return 2 * half_cols, 2 * half_cols + 1
    return half_cols, half_cols + HALF


@triton.jit
def _mla_decode_inputs_kernel(
        q_ptr, kv_a_ptr, positions_ptr, cos_ptr, sin_ptr, kv_norm_ptr, w_uk_ptr, out_ptr,
        cache_ptr, slot_mapping_ptr, T, q_stride, kv_a_stride, positions_stride, cos_stride,
        w_uk_stride_h, w_uk_stride_d, out_stride_t, out_stride_h, stride_cache_block,
        stride_cache_token, eps,
        NOPE: tl.constexpr, ROPE: tl.constexpr,
        KV_RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_KV: tl.constexpr,
        HALF_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr = False):
    t_block = tl.program_id(0)
    head = tl.program_id(1)
    l_block = tl.program_id(2)
    NUM_L_BLOCKS: tl.constexpr = KV_RANK // BLOCK_L
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    rows = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    q_row = q_ptr + rows64[:, None] * q_stride + head * (NOPE + ROPE)
    out_row = out_ptr + rows64[:, None] * out_stride_t + head * out_stride_h
    if l_block < NUM_L_BLOCKS:
        # W_UK's block is a weight: read before PDL's wait (kernels/pdl.py), so its bytes
        # stream while the kv_a projection before this kernel drains.
        d = tl.arange(0, BLOCK_NOPE)
        ls = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
        w = tl.load(w_uk_ptr + head * w_uk_stride_h + d[:, None] * w_uk_stride_d + ls[None, :],
                    mask=(d < NOPE)[:, None], other=0.0)
        pdl_start(PDL)
        q_nope = tl.load(q_row + d[None, :], mask=row_ok[:, None] & (d < NOPE)[None, :],
                         other=0.0)
        absorbed = tl.dot(q_nope, w, input_precision=DOT_PRECISION)
        tl.store(out_row + ls[None, :], absorbed.to(dtype), mask=row_ok[:, None])
    else:
        half: tl.constexpr = ROPE // 2
        cols = tl.arange(0, HALF_BLOCK)[None, :]
        col_ok = cols < half
        first, second = _rope_halves_offsets(cols, half, INTERLEAVED)
        # Positions, rotary rows, slots and the norm weight are the step's inputs and
        # constants: read before the wait.
        # (Rows past T read row 0's position: in bounds, and masked below.)
        cos, sin = rotary_cos_sin(positions_ptr, positions_stride,
                                  tl.where(row_ok, rows64, 0)[:, None], cos_ptr, sin_ptr,
                                  cos_stride, cols, col_ok, dtype)
        slots = tl.load(slot_mapping_ptr + rows64, mask=row_ok, other=-1).to(tl.int64)
        kv_cols = tl.arange(0, BLOCK_KV)
        kv_norm = tl.load(kv_norm_ptr + kv_cols, mask=kv_cols < KV_RANK,
                          other=0.0).to(tl.float32)[None, :]
        pdl_start(PDL)
        # Every load first (a load after a store waits for it: the compiler cannot tell
        # the pointers apart), so head 0's program makes one round trip to memory, not
        # two; the latent's loads are masked off in the other heads' programs.
        mask = row_ok[:, None] & col_ok
        x1 = tl.load(q_row + NOPE + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(q_row + NOPE + second, mask=mask, other=0.0).to(tl.float32)
        # (a row vector: the interpreter mistypes scalar-bool & tensor)
        latent_rows = ((rows * 0 + head) == 0)[:, None]
        kv_row = kv_a_ptr + rows64[:, None] * kv_a_stride
        kv_ok = row_ok[:, None] & (kv_cols < KV_RANK)[None, :]
        c_kv = tl.load(kv_row + kv_cols[None, :], mask=kv_ok & latent_rows,
                       other=0.0).to(tl.float32)
        k1 = tl.load(kv_row + KV_RANK + first, mask=mask & latent_rows,
                     other=0.0).to(tl.float32)
        k2 = tl.load(kv_row + KV_RANK + second, mask=mask & latent_rows,
                     other=0.0).to(tl.float32)
        x1, x2 = rotate_halves(x1, x2, cos, sin, dtype)
        tl.store(out_row + KV_RANK + cols, x1.to(dtype), mask=mask)
        tl.store(out_row + KV_RANK + half + cols, x2.to(dtype), mask=mask)
        if head == 0:
            # The latent of each row: normalised c_kv, then the rotated k_pe, at its slot
            # (slot -1 marks a padding row: masked, as the cache writer does).
            inv_rms = tl.math.rsqrt(tl.sum(c_kv * c_kv, axis=1) / KV_RANK + eps)[:, None]
            c_kv = scale_normalized(c_kv, inv_rms, kv_norm, dtype, dtype, False)
            k1, k2 = rotate_halves(k1, k2, cos, sin, dtype)
            dst = (cache_ptr + (slots // BLOCK_SIZE)[:, None] * stride_cache_block
                   + (slots % BLOCK_SIZE)[:, None] * stride_cache_token)
            real = (slots >= 0)[:, None]
            element = cache_ptr.dtype.element_ty
            tl.store(dst + kv_cols[None, :], c_kv.to(element), mask=kv_ok & real)
            tl.store(dst + KV_RANK + cols, k1.to(element), mask=mask & real)
            tl.store(dst + KV_RANK + half + cols, k2.to(element), mask=mask & real)


def mla_decode_inputs_unsupported(q: torch.Tensor, kv_a: torch.Tensor, w_uk: torch.Tensor,
                                  cos_cache: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take these operands (the unfused path then runs), or None."""
    heads, nope, kv_rank = w_uk.shape
    rope = kv_a.shape[-1] - kv_rank
    if q.dim() != 2 or q.shape[1] != heads * (nope + rope) or q.stride(1) != 1:
        return f"q {tuple(q.shape)} is not a row-major [T, {heads} x {nope + rope}] tensor"
    if kv_a.dim() != 2 or kv_a.stride(1) != 1 or w_uk.stride(2) != 1:
        return "kv_a or W_UK not contiguous along its last dimension"
    if kv_rank % BLOCK_L or rope % 2 or 2 * cos_cache.shape[-1] != rope:
        return f"latent {kv_rank} (a multiple of {BLOCK_L}), rotary {rope}"
    if kv_cache.dtype != q.dtype or q.dtype != kv_a.dtype or w_uk.dtype != q.dtype:
        return f"cache {kv_cache.dtype} with activations {q.dtype} (fp8 latent writers)"
    if kv_cache.dim() != 5 or kv_cache.shape[3:] != (1, kv_rank + rope) \
            or kv_cache.stride(-1) != 1:
        return f"latent cache of shape {tuple(kv_cache.shape)}"
    return None


def mla_decode_inputs(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                      kv_norm_weight: torch.Tensor, eps: float, w_uk: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      interleaved: bool) -> torch.Tensor:
    """q [T, H (nope + rope)] and kv_a [T, L + rope] (the layer's projections) -> the
    absorbed query [T, H, L + rope] for ``mla_decode``; the latent (RMSNorm'd c_kv, rotated
    k_pe) written into ``kv_cache`` at ``slot_mapping`` (slot -1 skipped). ``w_uk`` [H, nope,
    L]; ``interleaved``: the rope dimensions come as interleaved pairs (DeepSeek-V2). The
    caller checks ``mla_decode_inputs_unsupported`` first."""
    heads, nope, kv_rank = w_uk.shape
    rope = kv_a.shape[-1] - kv_rank
    t = q.shape[0]
    out = torch.empty((t, heads, kv_rank + rope), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    pdl = pdl_enabled(q.device)
    grid = (triton.cdiv(t, BLOCK_T), heads, kv_rank // BLOCK_L + 1)
    _mla_decode_inputs_kernel[grid](
        q, kv_a, positions, cos_cache, sin_cache, kv_norm_weight, w_uk, out, kv_cache,
        slot_mapping, t, q.stride(0), kv_a.stride(0), positions.stride(0), cos_cache.stride(0),
        w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1), kv_cache.stride(1),
        kv_cache.stride(2), float(eps),
        NOPE=nope, ROPE=rope, KV_RANK=kv_rank, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_T=BLOCK_T, BLOCK_L=BLOCK_L, BLOCK_NOPE=max(triton.next_power_of_2(nope), 16),
        BLOCK_KV=triton.next_power_of_2(kv_rank), HALF_BLOCK=triton.next_power_of_2(rope // 2),
        INTERLEAVED=interleaved, DOT_PRECISION=dot_precision(q.dtype), PDL=pdl, num_warps=4,
        **pdl_launch_options(pdl))
    return out
