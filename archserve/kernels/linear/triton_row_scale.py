"""The dynamic per-row scale of the W8A8 activation quantizers (FP8 and INT8): the row's
absmax over the format's largest value, with a floor, divided correctly rounded (``div_rn``)
to equal the torch reference's scale bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from archserve.kernels.linear.quantized_weights import MIN_ACTIVATION_SCALE

_MIN_SCALE: tl.constexpr = tl.constexpr(MIN_ACTIVATION_SCALE)


@triton.jit
def row_absmax_scale(x_row, K, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """max(absmax(x_row[:K]) / QMAX, MIN_ACTIVATION_SCALE) in fp32, read BLOCK at a time."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + offs
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    return tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), _MIN_SCALE)
