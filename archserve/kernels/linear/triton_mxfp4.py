"""MXFP4 (e2m1 values, an e8m0 scale per 32) decoded in registers, for Triton kernels.

Every GPU Triton targets runs these: the codes become floats through integer operations
and a bit cast, never a float4 type (native FP4 tensor cores exist on the SM100 and SM120
families only; there the native kernels are vLLM's and rules only here). The dense
weight-only GEMM and the fused MoE both read MXFP4 weights through them
(quantized_weights.Mxfp4Weight: bytes [N, K/2], two values a byte, low nibble first).

At many tokens a tile's decoded weights serve many rows, and the decode's cost is its
instructions, not its bytes: ``mxfp4_scaled_dot`` hands the packed tile to
``tl.dot_scaled``, whose lowering upcasts e2m1 with the compiler's own conversion sequence
and, on Hopper, swaps the operands so the upcast weight is wgmma's register operand (no
store to shared memory) while the activations stream in through the pipelined copies.

Exactness: an e2m1 value is an fp16 number (its 3 magnitude bits placed at fp16's lowest
exponent bits and first mantissa bit give it times 2**-14, subnormal 0.5 included), and
fp16 -> fp32 is exact; a scale 2**(s - 127) is an fp32 number built from its exponent
bits. So a decoded weight is value * scale exactly in fp32, and exactly in bf16 too (the
same exponent range), which is what dequantizing then multiplying computes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from archserve.kernels.linear.quantized_weights import MXFP4_GROUP

GROUP: tl.constexpr = tl.constexpr(MXFP4_GROUP)


@triton.jit
def e2m1_to_fp32(codes):
    """int32 e2m1 codes (0..15) -> their values as fp32 (exact)."""
    half = ((codes & 0x8) << 12) | ((codes & 0x7) << 9)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_fp32(scales):
    """uint8 e8m0 exponents s -> 2**(s - 127) as fp32, built from the exponent bits (s = 0,
    2**-127, reads as 0: below fp32's normal range, where GPUs flush to zero anyway)."""
    return (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_weight_tile(w_base, s_base, cols, col_ok, k0, K, stride_wn, stride_sn,
                      dtype: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dequantized weight tile [BLOCK_K, BLOCK_N] (rows k0.., columns ``cols``) in
    ``dtype``, as a tl.dot's second operand: bytes ``w_base + col * stride_wn + k // 2``,
    scales ``s_base + col * stride_sn + k // 32``. k0 and BLOCK_K are multiples of 32, K
    too (rows from K on are 0)."""
    BLOCK_P: tl.constexpr = BLOCK_K // 2
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    p = k0 // 2 + tl.arange(0, BLOCK_P)
    packed = tl.load(w_base + cols.to(tl.int64)[None, :] * stride_wn + p[:, None],
                     mask=(p < K // 2)[:, None] & col_ok[None, :], other=0).to(tl.int32)
    # [BLOCK_P, 2, BLOCK_N]: byte p's low nibble is row 2p, its high nibble row 2p + 1.
    codes = (packed[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF
    g = k0 // GROUP + tl.arange(0, BLOCK_G)
    s = tl.load(s_base + cols.to(tl.int64)[None, :] * stride_sn + g[:, None],
                mask=(g < K // GROUP)[:, None] & col_ok[None, :], other=0)
    values = tl.reshape(e2m1_to_fp32(codes), (BLOCK_G, GROUP, BLOCK_N))
    w = values * e8m0_to_fp32(s)[:, None, :]
    return tl.reshape(w, (BLOCK_K, BLOCK_N)).to(dtype)


@triton.jit
def mxfp4_row_pairs(w_rows, s_rows, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """(w[n, k0 + 2j], w[n, k0 + 2j + 1]) for the tile's rows n, each fp32 [N, BLOCK_K // 2]
    and dequantized, for a GEMV on the CUDA cores: bytes ``w_rows + k // 2`` and scales
    ``s_rows + k // 32`` ([N, 1] pointers, ``row_ok`` [N, 1]). The caller multiplies them
    by x's even and odd elements, read apart, so the bytes are used as read (no interleave).
    k0 and BLOCK_K are multiples of 32, K too (columns from K on are 0)."""
    BLOCK_P: tl.constexpr = BLOCK_K // 2
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    p = k0 // 2 + tl.arange(0, BLOCK_P)
    packed = tl.load(w_rows + p[None, :], mask=row_ok & (p < K // 2)[None, :],
                     other=0).to(tl.int32)
    g = k0 // GROUP + tl.arange(0, BLOCK_G)
    s = e8m0_to_fp32(tl.load(s_rows + g[None, :], mask=row_ok & (g < K // GROUP)[None, :],
                             other=0))
    rows: tl.constexpr = packed.shape[0]
    # A group's 16 bytes share its scale: [N, G, 16] against [N, G, 1].
    even = tl.reshape(e2m1_to_fp32(packed & 0xF), (rows, BLOCK_G, GROUP // 2)) * s[:, :, None]
    odd = tl.reshape(e2m1_to_fp32(packed >> 4), (rows, BLOCK_G, GROUP // 2)) * s[:, :, None]
    return tl.reshape(even, (rows, BLOCK_P)), tl.reshape(odd, (rows, BLOCK_P))


# The word decode: the packed bytes read as int32 words, 8 values a word (word w holds
# k = 8w .. 8w + 7, nibble i of the word value 8w + i). Nibbles i and i + 4 lie 16 bits
# apart, so shifts and masks place both codes as the two fp16 halves of an int32 (SASS
# for sm_90a: about 2.3 integer instructions and one fp16 -> fp32 conversion a value),
# against one code at a time through ``e2m1_to_fp32`` (a GEMV on the CUDA cores issues
# these for every value it streams; at decode sizes they, not the bytes, set its speed).
# Sign bits: 0x80008000 as an int32 (a larger literal would widen the words to int64).
_E2M1_MAGNITUDES: tl.constexpr = tl.constexpr(0x0E000E00)
_E2M1_SIGNS: tl.constexpr = tl.constexpr(-0x7FFF8000)


@triton.jit
def _e2m1_word_halves(words, SHIFT: tl.constexpr):
    """Nibbles SHIFT/4 and SHIFT/4 + 4 of each word as fp32 (the values times 2**-14)."""
    t = words >> SHIFT
    halves = ((t << 9) & _E2M1_MAGNITUDES) | ((t << 12) & _E2M1_SIGNS)
    low = halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def mxfp4_word_dots(w_rows, s_rows, row_ok, x, w0, K, BLOCK_W: tl.constexpr):
    """sum_j w[row, 8w + j] x[.., w, j] in fp32 for each row and word w = w0 .. w0 +
    BLOCK_W of this K step ([R, BLOCK_W], dequantized: times its group's scale): int32 words
    ``w_rows + w`` and scales ``s_rows + w // 4`` ([R, 1] pointers, ``row_ok`` [R, 1]); ``x``
    fp32 [1 or R, BLOCK_W, 8] (0 past K). K is a multiple of 32 (words from K / 8 on are 0).

    The words load 4 bytes a thread, a row's consecutive words on consecutive threads: then
    the activations' [.., BLOCK_W, 8] tile, loaded 16 bytes (8 values) a thread, lies on the
    threads that hold its words, and serves every row a thread holds without a layout
    change (16-byte word loads would put 4 words on a thread and need one, through shared
    memory, at every K step)."""
    w = tl.max_contiguous(w0 + tl.arange(0, BLOCK_W), 1)
    ok = row_ok & (w < K // 8)[None, :]
    words = tl.load(w_rows + w[None, :], mask=ok, other=0)
    scales = e8m0_to_fp32(tl.load(s_rows + w[None, :] // 4, mask=ok, other=0))
    rows: tl.constexpr = x.shape[0]
    # x[.., w, 4h + 2 i1 + i0]: split i0, then i1, then h.
    x_even, x_odd = tl.split(tl.reshape(x, (rows, BLOCK_W, 2, 2, 2)))
    x_02, x_26 = tl.split(x_even)
    x_13, x_37 = tl.split(x_odd)
    x0, x4 = tl.split(x_02)
    x2, x6 = tl.split(x_26)
    x1, x5 = tl.split(x_13)
    x3, x7 = tl.split(x_37)
    v0, v4 = _e2m1_word_halves(words, 0)
    v1, v5 = _e2m1_word_halves(words, 4)
    v2, v6 = _e2m1_word_halves(words, 8)
    v3, v7 = _e2m1_word_halves(words, 12)
    dots = (v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3) + (v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7)
    # 2**14 back first (exact), then the scale: no overflow the dequantized weights lack.
    return dots * 16384.0 * scales


@triton.jit
def mxfp4_tile_scales(s_base, cols, col_ok, k0, K, stride_sn, BLOCK_K: tl.constexpr):
    """The e8m0 scales of the tile at rows ``cols`` and K steps k0 .. k0 + BLOCK_K, uint8
    [N, BLOCK_K / 32] as tl.dot_scaled takes them (``s_base + col * stride_sn + k // 32``;
    0 past K, so a K step past the end loads nothing)."""
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    return tl.load(s_base + cols.to(tl.int64)[:, None] * stride_sn + g[None, :],
                   mask=col_ok[:, None] & (g < K // GROUP)[None, :], other=0)


@triton.jit
def mxfp4_scaled_dot(acc, a, w_base, scales, cols, col_ok, k0, K, stride_wn,
                     BLOCK_K: tl.constexpr):
    """acc [M, N] + a (bf16 [M, BLOCK_K]) @ W[cols, k0 .. k0 + BLOCK_K]ᵀ through
    tl.dot_scaled: the bytes ``w_base + col * stride_wn + k // 2`` as its right operand
    [BLOCK_K / 2, N] (packed along K, low nibble first: the checkpoint's order), and this
    K step's ``scales`` (``mxfp4_tile_scales``: the caller loads them a step ahead, since
    the pipeliner's asynchronous copies take the operands of the MMA, not the scales).
    k0 and BLOCK_K are multiples of 32, K too (masked bytes are 0). fast_math: no NaN for
    the e8m0 byte 255, which no quantizer writes."""
    p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_base + cols.to(tl.int64)[None, :] * stride_wn + p[:, None],
                     mask=col_ok[None, :] & (p < K // 2)[:, None], other=0)
    return tl.dot_scaled(a, None, "bf16", packed, scales, "e2m1", acc=acc, fast_math=True)
