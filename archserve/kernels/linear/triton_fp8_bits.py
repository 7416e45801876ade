"""FP8 e4m3 <-> wider floats with integer operations, for Triton kernels.

Two reasons not to use Triton's float8 types for these conversions:

* the weight-only GEMM must read FP8 weights on GPUs without FP8 hardware (SM70-SM88),
  where a float8 cast does not exist;
* Triton's CPU interpreter rounds fp32 -> float8 wrongly where the mantissa carries into
  the exponent (31.7 becomes 16, not 32), so a kernel that casts could not be checked on
  CPU against torch's conversion.

Both directions are exact as written: e4m3 values are a subset of fp16's, and the rounding
below is round-half-to-even with saturation already applied by the caller, which is what
``torch.Tensor.to(torch.float8_e4m3fn)`` does after the reference's clamp to +-448.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e4m3's 4-bit exponent (bias 7) sits in the low bits of fp16's 5-bit exponent (bias 15),
# so the fp16 built from the same bits is the e4m3 value times 2**-8: multiply by this.
E4M3_AS_FP16_SCALE: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def e4m3_bits_to_fp16(bits):
    """uint8 e4m3 bits -> fp16 holding the e4m3 value / 256 (exact, subnormals included).
    NaN (0x7F, 0xFF) becomes a finite value: checkpoints hold no NaN weights."""
    b = bits.to(tl.uint16)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def fp32_to_e4m3_bits(v):
    """fp32 ``v`` with |v| <= 448 -> uint8 e4m3 bits, rounded half to even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2**-6): keep 3 of fp32's 23 mantissa bits, rounding half to
    # even; a carry into the exponent is the correct next binade. Then rebias 127 -> 7.
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal e4m3 (multiples of 2**-9): |v| * 512 < 8 lands on an integer when added
    # to 2**23 (fp32 addition rounds half to even); its low bits are the code. 8 rounds
    # up to the smallest normal, whose code is 8 too.
    scaled = tl.abs(v) * 512.0 + 8388608.0
    sub = scaled.to(tl.uint32, bitcast=True) & 0xF
    code = tl.where(mag >= 0x3C800000, normal, sub)       # 0x3C800000 is 2**-6
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_activation(v, scale, inverse, HW_FP8: tl.constexpr):
    """The e4m3 value, in fp32, of activation ``v`` quantized with ``scale`` (clamped to
    +-448, rounded half to even): W8A8's quantized x, for a kernel that multiplies it in
    fp32. Without HW_FP8 it is the reference's arithmetic exactly (a correctly rounded
    v / scale, integer rounding). HW_FP8 (SM89+): v * ``inverse`` (1 / scale) and the
    hardware's cvt, a few instructions a value instead of some thirty; the product can
    differ from the correctly rounded quotient by an ulp, which moves a value that lies
    exactly on an e4m3 rounding tie to the other side (rare, one e4m3 step of one value)."""
    if HW_FP8:
        q = tl.minimum(tl.maximum(v * inverse, -448.0), 448.0)
        return q.to(tl.float8e4nv).to(tl.float32)
    else:
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        return e4m3_bits_to_fp16(fp32_to_e4m3_bits(q)).to(tl.float32) * E4M3_AS_FP16_SCALE
