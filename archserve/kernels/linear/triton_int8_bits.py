"""INT8 W8A8 activation rounding and int8 weight decoding for Triton kernels.

Activations round half to even, as the reference's torch.round: the quotient (a correctly
rounded ``div_rn``) is clamped to [-128, 127] and rounded by adding 1.5 * 2**23, whose fp32
sum keeps the integer in its low mantissa bits (fp32 addition rounds half to even; the
integer is read from the bits, so no compiler can fold the add away). Clamping before
rounding equals the reference's rounding then clamping, the bounds being integers. So the
integers equal ``quantize_activation_int8``'s exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

_ROUNDER: tl.constexpr = tl.constexpr(12582912.0)      # 1.5 * 2**23
_ROUNDER_BITS: tl.constexpr = tl.constexpr(0x4B400000)  # its fp32 bits
_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)    # 2**23's fp32 bits


@triton.jit
def int8_rounded(quotient):
    """int32 round-half-to-even of ``quotient`` (v / scale) clamped to [-128, 127]."""
    y = tl.minimum(tl.maximum(quotient, -128.0), 127.0)
    return (y + _ROUNDER).to(tl.int32, bitcast=True) - _ROUNDER_BITS


@triton.jit
def int8_activation(v, scale, inverse, FAST: tl.constexpr):
    """The int8 value, in fp32, of activation ``v`` quantized with ``scale``: the
    reference's arithmetic exactly, or with FAST v * ``inverse`` (1 / scale) for the
    correctly rounded quotient, which can differ by an ulp and move a value lying exactly
    on a rounding tie by one step (rare)."""
    if FAST:
        return int8_rounded(v * inverse).to(tl.float32)
    else:
        return int8_rounded(tl.math.div_rn(v, scale)).to(tl.float32)


@triton.jit
def int8_bits_to_fp32(bits):
    """uint8 bits of int8 values -> their fp32 values, exactly, without an int-to-float
    conversion (a quarter-rate instruction): bits ^ 0x80 is the value + 128, or'ed into the
    low mantissa bits of 2**23."""
    biased = (bits ^ 0x80).to(tl.int32) | _MAGIC_BITS
    return biased.to(tl.float32, bitcast=True) - 8388736.0     # 2**23 + 128
