"""Dequantize a weight-only layout to a dense 16-bit matrix in one pass, so a prefill GEMM
can run on cuBLAS: at many rows the dense product is tensor-core bound while the
dequantization is one read of the packed weight and one write of the dense one (vLLM's
AWQ layer does the same above 256 tokens).

* IntGroupWeight -> [K, N] (its own orientation: the write is coalesced along N), used
  as ``x @ dense``;
* Fp8Weight (per-channel or block scales) -> [N, K], used as ``x @ dense.T``;
* Mxfp4Weight -> [K, N] (coalesced along N, as the MMA kernel's tiles), ``x @ dense``.

The values are those of ``quantized_weights.dequantize`` rounded once to the output
dtype: q * scale + offset in fp32, FP8 bytes decoded with integer operations (so no FP8
hardware is needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.linear.quantized_weights import Fp8Weight, IntGroupWeight, Mxfp4Weight
from archserve.kernels.linear.triton_fp8_bits import E4M3_AS_FP16_SCALE, e4m3_bits_to_fp16
from archserve.kernels.linear.triton_mxfp4 import mxfp4_weight_tile


@triton.jit
def _dequantize_int_kernel(q_ptr, s_ptr, o_ptr, out_ptr, K, N, stride_q, stride_s, stride_o,
                           BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed rows pid(0)*BLOCK_P.. x columns pid(1)*BLOCK_N.. -> out [K, N]."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)   # the zero point of a symmetric layout
    prow = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (prow < K // PACK)[:, None] & (cols < N)[None, :]
    words = tl.load(q_ptr + prow.to(tl.int64)[:, None] * stride_q + cols[None, :], mask=ok,
                    other=0)
    for j in tl.static_range(PACK):
        k = prow * PACK + j
        g = k // GROUP
        s = tl.load(s_ptr + g.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        q = ((words >> (j * BITS)) & MASK).to(tl.float32)
        if HAS_OFFSETS:
            o = tl.load(o_ptr + g.to(tl.int64)[:, None] * stride_o + cols[None, :], mask=ok,
                        other=0.0).to(tl.float32)
            value = q * s + o
        else:
            value = (q - HALF) * s
        tl.store(out_ptr + k.to(tl.int64)[:, None] * N + cols[None, :],
                 value.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s,
                           BLOCK_SCALE_N: tl.constexpr, BLOCK_SCALE_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows pid(0)*BLOCK_N.. x columns pid(1)*BLOCK_K.. of the [N, K] weight."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    bits = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=ok,
                   other=0)
    value = e4m3_bits_to_fp16(bits).to(tl.float32) * E4M3_AS_FP16_SCALE
    if BLOCK_SCALE_N == 0:
        s = tl.load(s_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    else:
        s = tl.load(s_ptr + (rows // BLOCK_SCALE_N)[:, None] * stride_s
                    + (cols // BLOCK_SCALE_K)[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
             (value * s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_mxfp4_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s,
                             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid(0)*BLOCK_K.. x columns pid(1)*BLOCK_N.. of the dense [K, N] weight."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    tile = mxfp4_weight_tile(w_ptr, s_ptr, cols, col_ok, tl.program_id(0) * BLOCK_K, K,
                             stride_w, stride_s, out_ptr.dtype.element_ty, BLOCK_K, BLOCK_N)
    tl.store(out_ptr + ks.to(tl.int64)[:, None] * N + cols[None, :], tile,
             mask=(ks < K)[:, None] & col_ok[None, :])


def dequantize_int_group(weight: IntGroupWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [K, N] weight (input channels in ``perm`` order, as the GEMM's x)."""
    k, n = weight.in_features, weight.out_features
    out = torch.empty((k, n), dtype=dtype, device=weight.qweight.device)
    offsets = weight.offsets if weight.offsets is not None else weight.scales
    block_p, block_n = 8, 128
    grid = (triton.cdiv(k // weight.pack, block_p), triton.cdiv(n, block_n))
    _dequantize_int_kernel[grid](
        weight.qweight, weight.scales, offsets, out, k, n, weight.qweight.stride(0),
        weight.scales.stride(0), offsets.stride(0), BITS=weight.bits, GROUP=weight.group_size,
        HAS_OFFSETS=weight.offsets is not None, BLOCK_P=block_p, BLOCK_N=block_n)
    return out


def dequantize_fp8(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight."""
    n, k = weight.weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.weight.device)
    block_n, block_k = weight.block if weight.block is not None else (0, 1)
    tile_n, tile_k = 16, 128
    grid = (triton.cdiv(n, tile_n), triton.cdiv(k, tile_k))
    _dequantize_fp8_kernel[grid](
        weight.weight.view(torch.uint8), weight.weight_scale, out, n, k,
        weight.weight.stride(0), weight.weight_scale.stride(0) if weight.block else 0,
        BLOCK_SCALE_N=block_n, BLOCK_SCALE_K=block_k, BLOCK_N=tile_n, BLOCK_K=tile_k)
    return out


def dequantize_mxfp4(weight: Mxfp4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [K, N] weight."""
    k, n = weight.in_features, weight.out_features
    out = torch.empty((k, n), dtype=dtype, device=weight.blocks.device)
    tile_k, tile_n = 64, 64
    _dequantize_mxfp4_kernel[(triton.cdiv(k, tile_k), triton.cdiv(n, tile_n))](
        weight.blocks, weight.scales, out, n, k, weight.blocks.stride(0),
        weight.scales.stride(0), BLOCK_K=tile_k, BLOCK_N=tile_n)
    return out


def dequantized_linear(x: torch.Tensor, weight: IntGroupWeight | Fp8Weight | Mxfp4Weight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]: the weight dequantized to x's dtype, then one cuBLAS GEMM."""
    if isinstance(weight, IntGroupWeight):
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        y = x @ dequantize_int_group(weight, x.dtype)
    elif isinstance(weight, Mxfp4Weight):
        y = x @ dequantize_mxfp4(weight, x.dtype)
    else:
        y = x @ dequantize_fp8(weight, x.dtype).t()
    return y if bias is None else y + bias
