"""Weight-only quantized GEMM: y = x W^T (+ b), W stored as 4/8-bit integer groups
(IntGroupWeight), FP8 e4m3 (Fp8Weight executed weight-only) or MXFP4 (Mxfp4Weight: e2m1
values and an e8m0 scale per 32, decoded by triton_mxfp4), dequantized in registers.

One kernel family, two shapes of work, a constexpr switch for the weight kind:

* ``_weight_only_mma_kernel`` (prefill, more than MAX_GEMV_ROWS rows): tl.dot tiles. The
  integer or e4m3 values of a weight tile are exact in the activations' dtype (q - 2**(b-1)
  in -128..127, and every e4m3 value, are fp16 and bf16 numbers), so the tile is multiplied
  unscaled and the scale (and offset, through the tile's row sums of x) is applied to the
  fp32 product while the tile stays inside one group:
  ``sum_k x (q s + o) = s sum_k x (q - h) + (o + h s) sum_k x`` with h = 2**(bits-1).
* ``_weight_only_gemv_kernel`` (decode, up to MAX_GEMV_ROWS rows): the packed weight is
  read once, each int32 of an integer weight unpacked into its values in registers
  (coalesced along N, the layout's contiguous axis), FP8 and MXFP4 rows read along K
  (an MXFP4 byte's two values times x's even and odd elements); the fp32
  products accumulate per element and are summed over K once at the end. K may be split
  across programs (``split_k``) so a narrow layer still fills the GPU; the partial sums
  then go through an fp32 buffer, and the last split of each output tile to finish adds
  them in split order (``split_sum_counters``), so the result does not depend on which
  split finished last and no launch follows the GEMV.

The FP8 GEMV also runs W8A8 FP8 layers at decode sizes (``w8a8``): the checkpoint's
activation quantization (per token, per tensor, per 128-group) is done on x in its
registers, so no quantization kernel runs before it; the W8A8 routines' tuners time it
against their default (``w8a8_gemv_candidates``).

FP8 bytes are turned into fp16 with integer operations (triton_fp8_bits), never a float8
type, so the FP8 path runs on GPUs without FP8 hardware; where the hardware has FP8
conversions (SM89+) the GEMV uses them (``fp8_hardware``). On SM70/SM75 Triton lowers
tl.dot to FMA rather than tensor cores: correct there, not fast.

Configs are fixed per call (``default_config``: a small rule on rows, N, K and the
weight); ``candidate_configs`` lists what a start-up tuner may time instead.

Measured on an H200 (bf16, CUDA-graph replay, default configs, 4096x4096 / 4096x14336):
one row, int4 g128 11 / 25 us and FP8 9 / 31 us against cuBLAS bf16's 10 / 31 us; but
4 rows already 30 / 90 us (int4), and prefill (4096 rows) 4.5x (int) and 2.3x (FP8)
cuBLAS bf16's time. The MMA path's per-tile dequantization is what a tuner or a
dequantize-then-cuBLAS path for large M would have to beat.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype
from archserve.kernels.linear.gemm_tiles import ConfiguredRoutine, occupancy_block_n
from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
    FP8_MAX,
    INT8_MAX,
    MIN_ACTIVATION_SCALE,
    MXFP4_GROUP,
    Fp8Weight,
    Int8Weight,
    IntGroupWeight,
    Mxfp4Weight,
)
from archserve.kernels.linear.triton_dequantize import dequantized_linear
from archserve.kernels.linear.triton_fp8_bits import (
    E4M3_AS_FP16_SCALE,
    e4m3_activation,
    e4m3_bits_to_fp16,
)
from archserve.kernels.linear.triton_gemm_tile import output_tile, store_output_tile
from archserve.kernels.linear.triton_int8_bits import int8_activation, int8_bits_to_fp32
from archserve.kernels.linear.triton_mxfp4 import mxfp4_row_pairs, mxfp4_weight_tile
from archserve.kernels.rules import triton_interpreted
from archserve.platform.capability import SM89
from archserve.platform.detect import device_info_for

# How the FP8 GEMV treats x (ACT_QUANT): kept as it is (weight-only), or quantized to e4m3
# in registers as a W8A8 checkpoint's scheme says, so such a layer's decode GEMM needs no
# activation-quantization launch before it.
ACT_QUANT_NONE: tl.constexpr = tl.constexpr(0)
ACT_QUANT_TOKEN: tl.constexpr = tl.constexpr(1)
ACT_QUANT_STATIC: tl.constexpr = tl.constexpr(2)
ACT_QUANT_GROUP: tl.constexpr = tl.constexpr(3)
ACT_QUANT_MODES = {ACT_NONE: 0, ACT_DYNAMIC_TOKEN: 1, ACT_STATIC_TENSOR: 2, ACT_DYNAMIC_GROUP: 3}
ACT_GROUP = 128                  # channels per dynamic group scale (the weight block's K)
FP8_MAX_VALUE: tl.constexpr = tl.constexpr(FP8_MAX)
INT8_MAX_VALUE: tl.constexpr = tl.constexpr(INT8_MAX)
MIN_SCALE: tl.constexpr = tl.constexpr(MIN_ACTIVATION_SCALE)
INT_WEIGHT: tl.constexpr = tl.constexpr(0)
FP8_WEIGHT: tl.constexpr = tl.constexpr(1)
MXFP4_WEIGHT: tl.constexpr = tl.constexpr(2)
INT8_WEIGHT: tl.constexpr = tl.constexpr(3)     # Int8Weight rows (W8A8 only)
# Rows up to which the GEMV kernel runs; its fp32 accumulator holds rows x a weight tile.
MAX_GEMV_ROWS = 8
# Rows up to which a W8A8 FP8 layer's tuner also times the GEMV (activations quantized in
# its registers) against the quantize-then-tensor-core path: decode batches. Above 8 rows
# the GEMV runs blocks of 8 rows, each reading the weight again.
W8A8_GEMV_ROWS = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """A launch of one of the two kernels. GEMV: ``block_k`` counts unpacked values,
    ``split_k`` programs share K, ``prefetch`` requests each K step's next weight tile
    before computing (integer and FP8 weights). MMA: ``block_m`` rows per program,
    ``num_stages``."""

    gemv: bool
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 0
    num_stages: int = 1
    split_k: int = 1
    prefetch: int = 0

    def key(self) -> str:
        if self.gemv:
            return (f"gemv_n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}"
                    + (f"_p{self.prefetch}" if self.prefetch else ""))
        return (f"mma_m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}"
                f"_st{self.num_stages}")

    @classmethod
    def from_key(cls, key: str) -> WeightOnlyConfig:
        kind, *parts = key.split("_")
        values = {part.rstrip("0123456789"): int(part.lstrip("abcdefghijklmnopqrstuvwxyz"))
                  for part in parts}
        if kind == "gemv":
            return cls(True, values["n"], values["k"], values["w"], split_k=values["s"],
                       prefetch=values.get("p", 0))
        return cls(False, values["n"], values["k"], values["w"], block_m=values["m"],
                   num_stages=values["st"])


# ---- the kernels ------------------------------------------------------------------------

@triton.jit
def _int_group_params(scale_ptr, offset_ptr, g, cols, col_ok, stride_sg,
                      HAS_OFFSETS: tl.constexpr, BITS: tl.constexpr):
    """fp32 scale and offset of group(s) ``g`` (any shape broadcasting against cols)."""
    s = tl.load(scale_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_OFFSETS:
        o = tl.load(offset_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        HALF: tl.constexpr = 1 << (BITS - 1)
        o = s * (-HALF)
    return s, o


@triton.jit
def _centered_as(q, dtype: tl.constexpr, BITS: tl.constexpr):
    """Integers q in [0, 2**BITS) -> q - 2**(BITS-1) in ``dtype``, exactly, with bit
    operations and one subtraction instead of an int-to-float conversion (quarter rate on
    NVIDIA GPUs): or'ing q into the low mantissa bits of 1024 (fp16), 128 (bf16, 4-bit q)
    or 2**23 (fp32) gives that number plus q."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    if dtype == tl.float16:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return v - (1024.0 + HALF)
    elif dtype == tl.bfloat16 and BITS == 4:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return v - (128.0 + HALF)
    else:
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + HALF)
        return v.to(dtype)


@triton.jit
def _e4m3_weight(bits, HW_FP8: tl.constexpr):
    """uint8 e4m3 bits -> fp32: the value with HW_FP8 (the hardware's cvt), else the value
    / 256 (integer operations: no FP8 hardware needed)."""
    if HW_FP8:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_bits_to_fp16(bits).to(tl.float32)


@triton.jit
def _packed_tile(w_ptr, p, p_end, cols, col_ok, stride_w):
    """The int32 [len(p), len(cols)] tile of packed rows ``p`` (zeros from ``p_end``)."""
    return tl.load(w_ptr + p.to(tl.int64)[:, None] * stride_w + cols[None, :],
                   mask=(p < p_end)[:, None] & col_ok[None, :], other=0)


@triton.jit
def _absmax_scale(absmax, QMAX: tl.constexpr):
    """A W8A8 activation scale from its rows' (or group's) absmax, as the reference."""
    return tl.maximum(tl.math.div_rn(absmax, QMAX), MIN_SCALE)


@triton.jit
def _w8a8_activation(v, scale, inverse, KIND: tl.constexpr, HW_FP8: tl.constexpr,
                     FAST_DIV: tl.constexpr):
    """x's value after the W8A8 quantization of the weight's kind (scale not applied)."""
    if KIND == INT8_WEIGHT:
        return int8_activation(v, scale, inverse, FAST_DIV)
    else:
        return e4m3_activation(v, scale, inverse, HW_FP8)


@triton.jit
def _rows_absmax_scale(x_rows, row_ok, K, QMAX: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """[BLOCK_M] per-token scales over the whole of each row (a split program reads the
    rows' other K too: x is a few KB, in L2, against the weight's megabytes)."""
    amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    return _absmax_scale(tl.max(amax, axis=1), QMAX)


@triton.jit
def _weight_only_gemv_kernel(
        x_ptr, w_ptr, scale_ptr, offset_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
        stride_xm, stride_w, stride_s, stride_ym, stride_yk,
        KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_TILE: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_SCALE_N: tl.constexpr,
        BLOCK_SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        act_scale_ptr, ACT_QUANT: tl.constexpr = 0, HW_FP8: tl.constexpr = False,
        PREFETCH: tl.constexpr = False, FAST_DIV: tl.constexpr = False, sum_ptr=None,
        counter_ptr=None, splits=1, stride_sm=0, SUM_SPLITS: tl.constexpr = False):
    """Rows ``pid(2)*BLOCK_M..`` x columns ``pid(0)*BLOCK_N..`` over the K range of split
    ``pid(1)``. INT: w is int32 [K/pack, N] (stride_w per packed row), scales/offsets
    [K/GROUP, N]; GROUP_TILE: a BLOCK_K tile lies in one group. FP8: w is uint8 [N, K]
    (stride_w per row); BLOCK_SCALE_N == 0: per-channel scales [N], else block scales
    [ceil(N/bn), ceil(K/bk)] (stride_s per block row) with BLOCK_K dividing bk. MXFP4: w is
    uint8 [N, K/2] (stride_w per row), scales uint8 [N, K/32] (stride_s per row), BLOCK_K
    and the splits multiples of 32.
    INT8: w is int8 [N, K] (stride_w per row) with per-channel scales, x quantized to int8.
    ACT_QUANT (FP8 and INT8; see ``ACT_QUANT_MODES``): x is quantized as a W8A8
    checkpoint says, in registers: per row from the whole row's absmax, with the static
    scale at act_scale_ptr, or per 128-group (FP8; BLOCK_K == 128: a tile is one group).
    FAST_DIV (INT8): x / scale as x * (1 / scale) (HW_FP8 does so for FP8).
    HW_FP8 (SM89+): FP8 conversions by the hardware's cvt, two values an instruction.
    PREFETCH (INT, FP8): each K step requests the next step's weight tile before it
    computes on its own, which arrived during the step before: two tiles in flight per
    program instead of one (a tile past the split's end is masked: no bytes).
    PARTIAL: store fp32 sums to y[split] (stride_yk); with SUM_SPLITS the tile's last split
    to finish (``split_sum_counters``: one count a tile, ``splits`` in all) adds them in
    split order, with the bias, and writes sum_ptr (stride_sm a row) in its dtype;
    without, the host adds them up."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if KIND == INT_WEIGHT:
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        BLOCK_P: tl.constexpr = BLOCK_K // PACK
        prow = tl.arange(0, BLOCK_P)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_P, BLOCK_N], dtype=tl.float32)
        # q as fp32 without an int-to-float conversion (a quarter-rate instruction that
        # bounded this loop on an H200): the bits of 2**23 + q are those of 2**23 with q
        # or'ed in, and subtracting ZERO leaves q (offsets) or q - 2**(bits-1), exactly.
        MAGIC: tl.constexpr = 0x4B000000
        ZERO: tl.constexpr = 8388608.0 if HAS_OFFSETS else 8388608.0 + (1 << (BITS - 1))
        if PREFETCH:
            packed_next = _packed_tile(w_ptr, k_start // PACK + prow, k_end // PACK, cols,
                                       col_ok, stride_w)
        for k0 in range(k_start, k_end, BLOCK_K):
            p = k0 // PACK + prow                       # packed rows of this tile
            p_ok = p < k_end // PACK
            if PREFETCH:    # this tile was requested a step ago; request the next one
                packed = packed_next
                packed_next = _packed_tile(w_ptr, p + BLOCK_P, k_end // PACK, cols, col_ok,
                                           stride_w)
            else:
                packed = _packed_tile(w_ptr, p, k_end // PACK, cols, col_ok, stride_w)
            # The PACK values of an int32 share one group (GROUP is a multiple of PACK):
            # sum x q over them, then scale once per int32,
            #   sum_j x_j (q_j s + o) = s sum_j x_j q_j + o sum_j x_j.
            if BLOCK_M == 1:
                xq = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_P], dtype=tl.float32)
            else:
                xq = tl.zeros([BLOCK_M, BLOCK_P, BLOCK_N], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
            for j in tl.static_range(PACK):
                bits = ((packed >> (j * BITS)) & MASK) | MAGIC
                q = bits.to(tl.float32, bitcast=True) - ZERO    # [BLOCK_P, BLOCK_N]
                k = p * PACK + j
                if BLOCK_M == 1:
                    xk = tl.load(x_ptr + rows.to(tl.int64) * stride_xm + k, mask=p_ok,
                                 other=0.0).to(tl.float32)
                    xq += xk[:, None] * q
                else:
                    xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & p_ok[None, :],
                                 other=0.0).to(tl.float32)
                    xq += xk[:, :, None] * q[None, :, :]
                if HAS_OFFSETS:
                    x_sum += xk
            if GROUP_TILE:
                s, o = _int_group_params(scale_ptr, offset_ptr, k0 // GROUP, cols[None, :],
                                         col_ok[None, :], stride_s, HAS_OFFSETS, BITS)
            else:
                s, o = _int_group_params(scale_ptr, offset_ptr, (p * PACK // GROUP)[:, None],
                                         cols[None, :], p_ok[:, None] & col_ok[None, :],
                                         stride_s, HAS_OFFSETS, BITS)
            if BLOCK_M == 1:
                acc += xq * s
                if HAS_OFFSETS:
                    acc += x_sum[:, None] * o
            else:
                acc += xq * s[None, :, :]
                if HAS_OFFSETS:
                    acc += x_sum[:, :, None] * o[None, :, :]
        if BLOCK_M == 1:
            total = tl.sum(acc, axis=0)[None, :]
        else:
            total = tl.sum(acc, axis=1)
    elif KIND == MXFP4_WEIGHT:
        BLOCK_P: tl.constexpr = BLOCK_K // 2
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        s_rows = scale_ptr + cols.to(tl.int64)[:, None] * stride_s
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_P], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            even, odd = mxfp4_row_pairs(w_rows, s_rows, col_ok[:, None], k0, k_end, BLOCK_K)
            k = k0 + 2 * tl.arange(0, BLOCK_P)
            k_ok = k < k_end
            if BLOCK_M == 1:
                x_row = x_ptr + rows.to(tl.int64) * stride_xm
                x_even = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
                x_odd = tl.load(x_row + k + 1, mask=k_ok, other=0.0).to(tl.float32)
                acc += even * x_even[None, :] + odd * x_odd[None, :]
            else:
                x_ok = row_ok[:, None] & k_ok[None, :]
                x_even = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0).to(tl.float32)
                x_odd = tl.load(x_rows + k[None, :] + 1, mask=x_ok, other=0.0).to(tl.float32)
                acc += even[None, :, :] * x_even[:, None, :] + odd[None, :, :] * x_odd[:, None, :]
        if BLOCK_M == 1:
            total = tl.sum(acc, axis=1)[None, :]
        else:
            total = tl.sum(acc, axis=2)
    else:
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        # Per row (token) or per tensor: one scale a row over all of K, applied to the sums.
        QMAX: tl.constexpr = INT8_MAX_VALUE if KIND == INT8_WEIGHT else FP8_MAX_VALUE
        if ACT_QUANT == ACT_QUANT_TOKEN:
            x_scale = _rows_absmax_scale(x_rows, row_ok, K, QMAX, BLOCK_M, BLOCK_K)
        elif ACT_QUANT == ACT_QUANT_STATIC:
            x_scale = tl.zeros([BLOCK_M], tl.float32) + tl.load(act_scale_ptr).to(tl.float32)
        else:
            x_scale = tl.full([BLOCK_M], 1.0, tl.float32)
        x_inverse = 1.0 / x_scale
        if PREFETCH:
            bits_next = tl.load(w_rows + (k_start + ks)[None, :],
                                mask=col_ok[:, None] & (k_start + ks < k_end)[None, :], other=0)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + ks
            k_ok = k < k_end
            if PREFETCH:    # this tile was requested a step ago; request the next one
                bits = bits_next
                bits_next = tl.load(w_rows + (k + BLOCK_K)[None, :],
                                    mask=col_ok[:, None] & (k + BLOCK_K < k_end)[None, :],
                                    other=0)
            else:
                bits = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                               other=0)
            if KIND == INT8_WEIGHT:
                w = int8_bits_to_fp32(bits)
            else:
                w = _e4m3_weight(bits, HW_FP8)     # the e4m3 value (/ 256 without HW_FP8)
            if BLOCK_SCALE_N > 0:
                s = tl.load(scale_ptr + (cols // BLOCK_SCALE_N) * stride_s + k0 // BLOCK_SCALE_K,
                            mask=col_ok, other=0.0)
                w = w * s[:, None]
            if BLOCK_M == 1:
                xk = tl.load(x_ptr + rows.to(tl.int64) * stride_xm + k, mask=k_ok,
                             other=0.0).to(tl.float32)
                if ACT_QUANT == ACT_QUANT_GROUP:
                    g_scale = _absmax_scale(tl.max(tl.abs(xk), axis=0), FP8_MAX_VALUE)
                    xk = e4m3_activation(xk, g_scale, 1.0 / g_scale, HW_FP8) * g_scale
                elif ACT_QUANT != ACT_QUANT_NONE:
                    xk = _w8a8_activation(xk, x_scale, x_inverse, KIND, HW_FP8, FAST_DIV)
                acc += xk[None, :] * w
            else:
                xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)
                if ACT_QUANT == ACT_QUANT_GROUP:
                    g_scale = _absmax_scale(tl.max(tl.abs(xk), axis=1), FP8_MAX_VALUE)[:, None]
                    xk = e4m3_activation(xk, g_scale, 1.0 / g_scale, HW_FP8) * g_scale
                elif ACT_QUANT != ACT_QUANT_NONE:
                    xk = _w8a8_activation(xk, x_scale[:, None], x_inverse[:, None], KIND,
                                          HW_FP8, FAST_DIV)
                acc += xk[:, None, :] * w[None, :, :]
        if BLOCK_M == 1:
            total = tl.sum(acc, axis=1)[None, :]
        else:
            total = tl.sum(acc, axis=2)
        if KIND == FP8_WEIGHT and not HW_FP8:
            total = total * E4M3_AS_FP16_SCALE
        if ACT_QUANT == ACT_QUANT_TOKEN or ACT_QUANT == ACT_QUANT_STATIC:
            total = total * x_scale[:, None]
        if BLOCK_SCALE_N == 0:
            total = total * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        partials = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(partials + tl.program_id(1) * stride_yk, total, mask=out_ok)
        if SUM_SPLITS:
            # Every thread's partials stored before the count says so (release); the
            # last split's reads after it (acquire), from L2 (.cg: L1 is not coherent).
            tl.debug_barrier()
            tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == splits - 1:
                summed = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for split in range(0, splits):
                    summed += tl.load(partials + split * stride_yk, mask=out_ok, other=0.0,
                                      cache_modifier=".cg")
                if HAS_BIAS:
                    summed += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                sum_dtype: tl.constexpr = sum_ptr.dtype.element_ty
                tl.store(sum_ptr + rows[:, None] * stride_sm + cols[None, :],
                         round_to_dtype(summed, sum_dtype).to(sum_dtype), mask=out_ok)
                tl.atomic_xchg(counter_ptr + tile, 0)    # zero for the next launch
    else:
        dtype: tl.constexpr = y_ptr.dtype.element_ty
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(out, round_to_dtype(total, dtype).to(dtype), mask=out_ok)


@triton.jit
def _weight_only_mma_kernel(
        x_ptr, w_ptr, scale_ptr, offset_ptr, b_ptr, y_ptr, M, N, K,
        stride_xm, stride_w, stride_s, stride_ym,
        KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        HAS_OFFSETS: tl.constexpr, BLOCK_SCALE_N: tl.constexpr, BLOCK_SCALE_K: tl.constexpr,
        SCALE_AT_END: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] of y per program. INT: BLOCK_K divides GROUP (or K is one group,
    GROUP == K) so a tile has one scale per column. FP8 block scales: BLOCK_K divides bk.
    SCALE_AT_END (one scale per column over all of K: per-channel FP8, or one INT group):
    tl.dot accumulates into one fp32 tile, which Hopper's wgmma pipelines; otherwise each
    tile's product is scaled before it is added."""
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    HALF: tl.constexpr = 1 << (BITS - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)     # sum_k x, for the INT offsets
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if KIND == INT_WEIGHT:
            PACK: tl.constexpr = 32 // BITS
            BLOCK_P: tl.constexpr = BLOCK_K // PACK
            # Read each int32 once and shift its PACK values apart: [BLOCK_P, PACK, N] is
            # row k = p * PACK + j, so the reshape lists the rows in order.
            p = k0 // PACK + tl.arange(0, BLOCK_P)
            packed = tl.load(w_ptr + p.to(tl.int64)[:, None] * stride_w + cols[None, :],
                             mask=(p < K // PACK)[:, None] & col_ok[None, :], other=0)
            shifts = tl.arange(0, PACK) * BITS
            # Centred on HALF: -128..127 are exact in fp16 and bf16, and the product keeps
            # no large common term that the offsets would cancel after fp32 rounding.
            q = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
            b = _centered_as(tl.reshape(q, (BLOCK_K, BLOCK_N)), dtype, BITS)
        elif KIND == MXFP4_WEIGHT:
            # Dequantized (scales applied) in registers: exact in bf16 and fp32.
            b = mxfp4_weight_tile(w_ptr, scale_ptr, cols, col_ok, k0, K, stride_w, stride_s,
                                  dtype, BLOCK_K, BLOCK_N)
        else:
            bits = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + k[:, None],
                           mask=k_ok[:, None] & col_ok[None, :], other=0)
            b = e4m3_bits_to_fp16(bits).to(dtype)       # the e4m3 value / 256, exact
        if SCALE_AT_END:
            if dtype == tl.float32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if KIND == INT_WEIGHT and HAS_OFFSETS:
                x_sum += tl.sum(a.to(tl.float32), axis=1)
        else:
            if dtype == tl.float32:
                t = tl.dot(a, b, input_precision="ieee")
            else:
                t = tl.dot(a, b)
            if KIND == INT_WEIGHT:
                s, o = _int_group_params(scale_ptr, offset_ptr, k0 // GROUP, cols, col_ok,
                                         stride_s, HAS_OFFSETS, BITS)
                if HAS_OFFSETS:     # w = (q - HALF) s + (o + HALF s); symmetric: no 2nd term
                    row_sum = tl.sum(a.to(tl.float32), axis=1)
                    acc += t * s[None, :] + row_sum[:, None] * (o + HALF * s)[None, :]
                else:
                    acc += t * s[None, :]
            else:
                s = tl.load(scale_ptr + (cols // BLOCK_SCALE_N) * stride_s + k0 // BLOCK_SCALE_K,
                            mask=col_ok, other=0.0)
                acc += t * s[None, :]
    if KIND == FP8_WEIGHT:
        acc = acc * E4M3_AS_FP16_SCALE
        if SCALE_AT_END:
            acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    elif KIND == INT_WEIGHT and SCALE_AT_END:
        s, o = _int_group_params(scale_ptr, offset_ptr, 0, cols, col_ok, stride_s, HAS_OFFSETS,
                                 BITS)
        acc = acc * s[None, :]
        if HAS_OFFSETS:
            acc += x_sum[:, None] * (o + HALF * s)[None, :]
    store_output_tile(y_ptr, acc, b_ptr, rows, cols, row_ok, col_ok, stride_ym, HAS_BIAS)


# ---- what a weight allows ----------------------------------------------------------------

WeightOnly = IntGroupWeight | Fp8Weight | Mxfp4Weight
# The byte-per-value row layouts the GEMV also runs as W8A8 (``w8a8``), activations
# quantized in its registers.
W8A8Weight = Fp8Weight | Int8Weight


def _largest_pow2_divisor(value: int, cap: int) -> int:
    d = 1
    while d < cap and value % (2 * d) == 0:
        d *= 2
    return d


def mma_block_k_limit(weight: WeightOnly) -> int:
    """The largest BLOCK_K the MMA kernel may take for this weight (0: it cannot run it):
    a tile must lie in one scale group (INT) or one scale block along K (FP8); an MXFP4
    tile is whole groups of 32 (the MMA kernel scales it in registers)."""
    if isinstance(weight, Mxfp4Weight):
        return 128
    if isinstance(weight, IntGroupWeight):
        if weight.group_size == weight.in_features:
            return 128
        limit = _largest_pow2_divisor(weight.group_size, 128)
    elif weight.block is not None:
        limit = _largest_pow2_divisor(weight.block[1], 128)
    else:
        return 128
    return limit if limit >= 16 else 0


def weight_only_unsupported(x: torch.Tensor, weight: WeightOnly,
                            bias: torch.Tensor | None) -> str | None:
    """Why these kernels cannot take these operands, or None."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        return f"x {tuple(x.shape)} for in_features {weight.in_features}"
    if x.dtype not in DTYPES:
        return f"activations are {x.dtype}"
    if bias is not None and tuple(bias.shape) != (weight.out_features,):
        return f"bias {tuple(bias.shape)}"
    if isinstance(weight, IntGroupWeight):
        if weight.bits not in (4, 8):
            return f"{weight.bits}-bit weights"
        if weight.group_size % weight.pack and weight.group_size != weight.in_features:
            return (f"group size {weight.group_size} is not a multiple of the "
                    f"{weight.pack} values per int32")
        if weight.qweight.stride(1) != 1:
            return "packed weight not contiguous along N"
        return None
    if isinstance(weight, Int8Weight):
        if weight.weight.stride(1) != 1:
            return "INT8 weight not contiguous along K"
        if weight.weight_scale.numel() != weight.out_features:
            return f"INT8 weight scales {tuple(weight.weight_scale.shape)}: expected one per row"
        return None
    if isinstance(weight, Fp8Weight):
        if weight.weight.stride(1) != 1:
            return "FP8 weight not contiguous along K"
        if weight.block is not None and _largest_pow2_divisor(weight.block[1], 1 << 30) < 16:
            return f"FP8 scale block {weight.block}: its K side must be a multiple of 16"
        if weight.block is None and weight.weight_scale.numel() != weight.out_features:
            return f"FP8 weight scales {tuple(weight.weight_scale.shape)}: expected one per row"
        return None
    if isinstance(weight, Mxfp4Weight):
        if weight.blocks.stride(1) != 1 or weight.scales.stride(1) != 1:
            return "MXFP4 blocks and scales not contiguous along K"
        return None
    return f"{type(weight).__name__} is not a weight-only layout"


# ---- configs -----------------------------------------------------------------------------

def _gemv_rows(rows: int) -> int:
    return triton.next_power_of_2(max(1, min(rows, MAX_GEMV_ROWS)))


def _split_k(programs_n: int, k: int, block_k: int, split: int | None = None) -> int:
    """Split K until about 512 programs run (four per SM of a large GPU: the loads of a
    program's tile are its only bytes in flight), each split at least two tiles deep."""
    if split is not None:
        return split
    tiles_k = triton.cdiv(k, block_k)
    split = 1
    while programs_n * split < 512 and tiles_k // (2 * split) >= 2:
        split *= 2
    return split


# (block_n, block_k, num_warps) of the FP8 GEMV by rows (block_k in values), default first.
_FP8_GEMV_TILES = {1: [(8, 512, 4), (4, 1024, 4), (16, 256, 4)],
                   2: [(4, 512, 4), (8, 256, 4), (2, 1024, 4)],
                   4: [(4, 256, 4), (2, 512, 4), (8, 128, 4)],
                   8: [(2, 256, 4), (4, 128, 4), (1, 512, 4)]}


def _gemv_tiles(rows: int, weight: WeightOnly) -> list[tuple[int, int, int]]:
    """(block_n, block_k, num_warps) worth running at this many rows, the default first.
    The accumulator (rows x tile) stays at or below 2048 fp32 values per 128 threads."""
    block_m = _gemv_rows(rows)
    if isinstance(weight, IntGroupWeight):
        pack = weight.pack
        # Packed rows per tile by block_m: coalesced along N, 64 or 128 columns.
        packed = {1: 16, 2: 8, 4: 8, 8: 4}[block_m]
        tiles = [(64, packed * pack, 4), (128, max(1, packed // 2) * pack, 4),
                 (32, packed * 2 * pack, 4), (128, packed * pack, 8)]
        # One row: 32 columns x 64 packed rows on 8 warps was the best tile at every
        # Llama-3-8B shape of an H200 sweep (benchmarks/sweep_weight_only_gemv.py), with
        # its best split 1.2-1.3x faster than the former default (the first tile below).
        return [(32, 64 * pack, 8)] + tiles if block_m == 1 else tiles
    if isinstance(weight, Mxfp4Weight):
        # FP8's tiles in values (half its bytes: two values a byte), twice its columns;
        # the accumulator holds rows x columns x half a tile's values.
        return [(2 * bn, bk, w) for bn, bk, w in _FP8_GEMV_TILES[block_m]]
    tiles = _FP8_GEMV_TILES[block_m]            # FP8 and INT8: a byte a value
    if isinstance(weight, Int8Weight) or weight.block is None:
        return tiles
    limit = mma_block_k_limit(weight)
    # Block scales: a tile lies in one scale block along K; keep the tile's size.
    return [(min(64, bn * bk // min(bk, limit)), min(bk, limit), w) for bn, bk, w in tiles]


def _gemv_config(rows: int, n: int, k: int, tile: tuple[int, int, int],
                 split: int | None = None) -> WeightOnlyConfig:
    block_n, block_k, warps = tile
    return WeightOnlyConfig(True, block_n, block_k, warps,
                            split_k=_split_k(triton.cdiv(n, block_n), k, block_k, split))


def _mma_block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


def _mma_config(rows: int, n: int, weight: WeightOnly, block_n: int | None = None,
                block_k: int = 64, num_warps: int | None = None, num_stages: int = 2
                ) -> WeightOnlyConfig:
    block_m = _mma_block_m(rows)
    if block_n is None:
        block_n = occupancy_block_n(rows, n, block_m)
    block_k = min(block_k, mma_block_k_limit(weight))
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return WeightOnlyConfig(False, block_n, block_k, num_warps, block_m=block_m,
                            num_stages=num_stages)


def default_config(rows: int, n: int, k: int, weight: WeightOnly) -> WeightOnlyConfig:
    """The fixed launch at ``rows`` rows: the GEMV up to MAX_GEMV_ROWS rows (or where no
    MMA tile fits the weight's groups), the MMA kernel above."""
    if rows <= MAX_GEMV_ROWS or mma_block_k_limit(weight) == 0:
        return _gemv_config(rows, n, k, _gemv_tiles(rows, weight)[0])
    return _mma_config(rows, n, weight)


def _gemv_candidates(rows: int, n: int, k: int, weight: WeightOnly) -> list[WeightOnlyConfig]:
    """Every GEMV tile at the split that fills the GPU and at twice that many programs;
    the first tile also at four times (more loads in flight; the partial sums cost one
    more small pass) and, for integer and FP8 weights, at its first two splits with two
    tiles in flight per program (``prefetch``): where a program's tile is its only load
    in flight, that doubles the bytes in flight without more programs."""
    configs = []
    for i, tile in enumerate(_gemv_tiles(rows, weight)):
        split = _split_k(triton.cdiv(n, tile[0]), k, tile[1])
        deep = i == 0 and triton.cdiv(k, tile[1]) >= 4 * split
        configs += [_gemv_config(rows, n, k, tile, s)
                    for s in ((split, 2 * split, 4 * split) if deep else (split, 2 * split))]
    if not isinstance(weight, Mxfp4Weight):
        configs += [dataclasses.replace(c, prefetch=1) for c in configs[:2]
                    if triton.cdiv(k, c.block_k) >= 2 * c.split_k]
    return configs


def w8a8_gemv_candidates(rows: int, weight: WeightOnly) -> list[WeightOnlyConfig]:
    """The GEMV configs that may run a W8A8 FP8 layer at ``rows`` rows with its
    activations quantized in-kernel (``weight_only_gemm(..., w8a8=True)``): none above
    W8A8_GEMV_ROWS or where the GEMV cannot take the weight."""
    probe = torch.empty((0, weight.in_features))      # the weight's own conditions only
    if rows > W8A8_GEMV_ROWS or weight_only_unsupported(probe, weight, None) is not None \
            or w8a8_gemv_unsupported(probe, weight) is not None:
        return []
    configs = _gemv_candidates(rows, weight.out_features, weight.in_features, weight)
    if weight.activation == ACT_DYNAMIC_GROUP:        # a K tile is one activation group
        configs = [c for c in configs if c.block_k == ACT_GROUP]
    return list(dict.fromkeys(configs))


def candidate_configs(rows: int, n: int, k: int, weight: WeightOnly) -> list[WeightOnlyConfig]:
    """What a start-up tuner may time at ``rows`` rows, ``default_config`` first."""
    configs = [default_config(rows, n, k, weight)]
    if configs[0].gemv:
        configs += _gemv_candidates(rows, n, k, weight)
    else:
        limit = mma_block_k_limit(weight)
        for block_n, block_k, warps, stages in [(128, 64, 4, 3), (64, 64, 4, 3),
                                                (32, 64, 4, 3), (128, 32, 4, 4),
                                                (128, 64, 8, 3), (256, 64, 8, 3)]:
            configs.append(_mma_config(rows, n, weight, block_n, min(block_k, limit), warps,
                                       stages))
    unique: list[WeightOnlyConfig] = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


# ---- the call ----------------------------------------------------------------------------

def _weight_operands(weight: WeightOnly) -> tuple[tuple, dict]:
    """(w, scale, offset pointers, strides of w and scale) and the kind's constexprs."""
    if isinstance(weight, IntGroupWeight):
        scales = weight.scales.contiguous()
        offsets = weight.offsets.contiguous() if weight.offsets is not None else scales
        tensors = (weight.qweight, scales, offsets, weight.qweight.stride(0), scales.stride(0))
        return tensors, dict(KIND=INT_WEIGHT, BITS=weight.bits, GROUP=weight.group_size,
                             HAS_OFFSETS=weight.offsets is not None, BLOCK_SCALE_N=0,
                             BLOCK_SCALE_K=1)
    if isinstance(weight, Mxfp4Weight):
        tensors = (weight.blocks, weight.scales, weight.scales, weight.blocks.stride(0),
                   weight.scales.stride(0))
        return tensors, dict(KIND=MXFP4_WEIGHT, BITS=4, GROUP=MXFP4_GROUP, HAS_OFFSETS=False,
                             BLOCK_SCALE_N=0, BLOCK_SCALE_K=1)
    scale = weight.weight_scale
    block = getattr(weight, "block", None)      # Int8Weight: per-channel scales
    block_n, block_k = block if block is not None else (0, 1)
    tensors = (weight.weight.view(torch.uint8), scale, scale, weight.weight.stride(0),
               scale.stride(0) if block is not None else 0)
    return tensors, dict(KIND=INT8_WEIGHT if isinstance(weight, Int8Weight) else FP8_WEIGHT,
                         BITS=8, GROUP=1, HAS_OFFSETS=False, BLOCK_SCALE_N=block_n,
                         BLOCK_SCALE_K=block_k)


def fp8_hardware(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert FP8 with the hardware's instructions (SM89+;
    never under the interpreter, whose float8 rounding is wrong at carries)."""
    if triton_interpreted():
        return False
    info = device_info_for(device)
    return info.is_cuda and info.has_capability(SM89)


def w8a8_gemv_unsupported(x: torch.Tensor, weight: W8A8Weight) -> str | None:
    """Why the GEMV cannot run this W8A8 FP8 or INT8 weight with its activation scheme
    in-kernel."""
    if not isinstance(weight, W8A8Weight) or weight.activation not in ACT_QUANT_MODES:
        return "not an FP8 or INT8 weight with a known activation scheme"
    if isinstance(weight, Int8Weight) and weight.activation == ACT_DYNAMIC_GROUP:
        return "INT8 weights take per-token or per-tensor activation scales"
    if weight.activation == ACT_STATIC_TENSOR and weight.input_scale is None:
        return "static activation scheme without an input scale"
    if weight.activation == ACT_DYNAMIC_GROUP and (
            weight.in_features % ACT_GROUP or weight.block is None
            or weight.block[1] % ACT_GROUP):
        return f"per-group activations need K and the weight blocks' K divisible by {ACT_GROUP}"
    return None


def weight_only_gemm(x: torch.Tensor, weight: WeightOnly, bias: torch.Tensor | None = None,
                     config: WeightOnlyConfig | None = None, w8a8: bool = False
                     ) -> torch.Tensor:
    """x [M, K] (fp16, bf16, fp32), an IntGroupWeight, Fp8Weight (its activation scheme
    ignored: weight-only) or Mxfp4Weight, bias [N] or None -> [M, N] in x's dtype. Act order: x is
    gathered by ``weight.perm`` first. The caller checks ``weight_only_unsupported``.
    ``w8a8`` (an Fp8Weight, a GEMV config; ``w8a8_gemv_unsupported``): x is quantized by
    the weight's activation scheme inside the GEMV, no launch before it; per-group scales
    need a ``block_k`` of 128."""
    if isinstance(weight, IntGroupWeight) and weight.perm is not None:
        x = x.index_select(1, weight.perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, depth = x.shape
    cols = weight.out_features
    config = config or default_config(rows, cols, depth, weight)
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    (w, scale, offset, stride_w, stride_s), kind = _weight_operands(weight)
    b = bias if bias is not None else y
    if w8a8 and not config.gemv:
        raise ValueError("activations are quantized in the GEMV only")
    if not config.gemv:
        grid = (triton.cdiv(cols, config.block_n), triton.cdiv(rows, config.block_m))
        scale_at_end = (kind["BLOCK_SCALE_N"] == 0 if kind["KIND"] == FP8_WEIGHT
                        else kind["KIND"] == MXFP4_WEIGHT or weight.group_size == depth)
        _weight_only_mma_kernel[grid](
            x, w, scale, offset, b, y, rows, cols, depth, x.stride(0), stride_w, stride_s,
            y.stride(0), **kind, SCALE_AT_END=scale_at_end, HAS_BIAS=bias is not None,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
            num_stages=config.num_stages)
        return y
    k_per_split = triton.cdiv(triton.cdiv(depth, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(depth, k_per_split)
    block_m = _gemv_rows(rows)
    group_tile = kind["KIND"] == INT_WEIGHT and (
        weight.group_size % config.block_k == 0 or weight.group_size == depth)
    out = y if splits == 1 else torch.empty((splits, rows, cols), dtype=torch.float32,
                                            device=x.device)
    grid = (triton.cdiv(cols, config.block_n), splits, triton.cdiv(rows, block_m))
    fp8 = dict(act_scale_ptr=scale)
    if kind["KIND"] in (FP8_WEIGHT, INT8_WEIGHT):
        scheme = weight.activation if w8a8 else ACT_NONE
        if scheme == ACT_DYNAMIC_GROUP and config.block_k != ACT_GROUP:
            raise ValueError(f"per-group activations need block_k {ACT_GROUP}, "
                             f"the config has {config.block_k}")
        fp8 = dict(act_scale_ptr=weight.input_scale if scheme == ACT_STATIC_TENSOR else scale,
                   ACT_QUANT=ACT_QUANT_MODES[scheme], HW_FP8=fp8_hardware(x.device),
                   FAST_DIV=not triton_interpreted())
    counters = split_sum_counters(x.device, grid[0] * grid[2]) if splits > 1 else None
    sums = {} if counters is None else dict(sum_ptr=y, counter_ptr=counters, splits=splits,
                                            stride_sm=y.stride(0), SUM_SPLITS=True)
    _weight_only_gemv_kernel[grid](
        x, w, scale, offset, b, out, rows, cols, depth, k_per_split, x.stride(0), stride_w,
        stride_s, out.stride(-2), out.stride(0) if splits > 1 else 0, **kind,
        GROUP_TILE=group_tile, HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
        PREFETCH=bool(config.prefetch) and kind["KIND"] != MXFP4_WEIGHT, **fp8, **sums)
    if splits == 1 or counters is not None:
        return y
    total = out.sum(dim=0)
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)


# The split-K GEMV's counts: one int32 a (column, row) tile, zero between launches (each
# tile's last split resets its own), so a captured CUDA graph finds them zero at every
# replay. One buffer a device, shared by every GEMV on it: they run one after another
# on the compute stream.
MAX_SPLIT_TILES = 1 << 15
_split_counters: dict[torch.device, torch.Tensor] = {}


def split_sum_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's split-K counts, or None where a launch has more tiles than they hold
    (the host adds that launch's partials)."""
    if tiles > MAX_SPLIT_TILES:
        return None
    counters = _split_counters.get(device)
    if counters is None:
        counters = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
        _split_counters[device] = counters
    return counters


# From this many rows a GEMM with no tuned config dequantizes the weight once
# (triton_dequantize) and runs cuBLAS: the MMA kernel's per-tile dequantization measured
# 2.3-4.5x cuBLAS bf16 at 4096 rows on an H200, while a dequantization pass costs about one
# dense weight write. vLLM's AWQ layer switches at 256 tokens too. At decode graph sizes
# the start-up tuner chooses between the two (DENSE_CONFIG is the dequantize path).
DENSE_PREFILL_ROWS = 256
DENSE_CONFIG = WeightOnlyConfig(False, 0, 0, 0)


class WeightOnlyLinear(ConfiguredRoutine):
    """The TRITON_WEIGHT_ONLY routine. From DENSE_PREFILL_ROWS rows (and no tuned config)
    the weight is dequantized for one cuBLAS GEMM instead."""

    config_type = WeightOnlyConfig

    def run(self, x, weight, bias, config):  # noqa: ANN001, ANN201
        if config == DENSE_CONFIG or (config is None and x.shape[0] >= DENSE_PREFILL_ROWS):
            return dequantized_linear(x, weight, bias)
        return weight_only_gemm(x, weight, bias, config)

    def candidates(self, rows: int, weight) -> list:  # noqa: ANN001
        """The kernel's configs, the default first; above the GEMV's rows also the
        dequantize-then-cuBLAS path (first from DENSE_PREFILL_ROWS, where it is the
        default)."""
        configs = candidate_configs(rows, weight.out_features, weight.in_features, weight)
        if rows <= MAX_GEMV_ROWS:
            return configs
        return [DENSE_CONFIG] + configs if rows >= DENSE_PREFILL_ROWS else configs + [
            DENSE_CONFIG]
