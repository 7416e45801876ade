"""SiLU(gate) * up in Triton: x [T, 2I] (gate first, as GateUpLinear stores) -> [T, I].

Like ``silu_and_mul_reference`` (and torch's own kernels), silu(gate) is computed in fp32
and rounded to the activations' dtype before the multiply by up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    activated = round_to_dtype(gate * tl.sigmoid(gate), dtype)
    tl.store(out_ptr + row * width + cols, round_to_dtype(activated * up, dtype).to(dtype),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_reference``; x's rows may be strided."""
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, 2 * width)  # a view for any output of a linear layer
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(width))
    grid = (rows.shape[0], triton.cdiv(width, block))
    _silu_mul_kernel[grid](rows, out, rows.stride(0), width, BLOCK=block,
                           num_warps=min(max(block // 256, 1), 4))
    return out
