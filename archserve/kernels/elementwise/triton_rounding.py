"""Rounding an fp32 value to a narrower float while keeping it in fp32 registers.

The torch references round intermediate results to the activations' dtype (e.g. the
normalised row before the weight multiply); the kernels do the same so that they agree
with the reference to the last bit wherever the arithmetic allows. bf16 is rounded with
integer operations rather than a cast because Triton's CPU interpreter truncates on an
fp32 -> bf16 cast where the GPU rounds to nearest even; rounding by hand gives both the
GPU's result, and a value already representable in bf16 then casts exactly everywhere.
fp16 is rounded by hand too (see below).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """fp32 ``x`` -> fp32 holding the nearest ``DTYPE`` value (round half to even)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # Adding 0x7FFF plus the lowest kept bit, then dropping 16 bits, rounds half to even.
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)  # NaN payloads must not carry into the sign
    elif DTYPE == tl.float16:
        # Also by hand: on the GPU a cast round trip (fp32 -> fp16 -> fp32) can be folded
        # away, leaving the product unrounded (seen on an H200 as ~1% one-unit flips against
        # torch). Normal fp16 values keep 10 of fp32's 23 mantissa bits.
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0xFFF + ((bits >> 13) & 1)
        rounded = ((bits >> 13) << 13).to(tl.float32, bitcast=True)
        overflow = tl.where(x > 0, float("inf"), float("-inf"))
        rounded = tl.where(tl.abs(rounded) > 65504.0, overflow, rounded)
        # fp16 subnormals (below 2**-14) have fewer bits; the cast handles those rare values.
        rounded = tl.where(tl.abs(x) < 6.103515625e-05, x.to(tl.float16).to(tl.float32), rounded)
        return tl.where(x != x, x, rounded)
    else:
        return x
