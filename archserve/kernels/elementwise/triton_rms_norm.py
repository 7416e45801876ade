"""Fused residual-add + RMSNorm in Triton: one program per row, one pass over memory.

Numerics follow ``rms_norm_reference``: the sum x + residual is rounded to the input
dtype (it is the next residual), statistics are fp32, the normalised row is rounded to
the input dtype before the weight multiply (as Hugging Face does), and the product is
rounded to the output dtype, which is the promotion of the weight's and the input's.
With UNIT_OFFSET (Gemma) the row is scaled by 1 + weight in fp32 and rounded once, to
the input dtype.

Rows may be strided two ways, so a per-head q/k norm reads [T, H, D] views of the fused
qkv output without a copy: row r is at (r // rows_per_group) * group_stride +
(r % rows_per_group) * row_stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start


@triton.jit
def scale_normalized(x, inv_rms, w, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr):
    """fp32 ``x`` times its fp32 1/rms, then the fp32 weight ``w``, rounded as the
    reference rounds: to IN_DTYPE before the weight (HF), to OUT_DTYPE after it; Gemma's
    form (UNIT_OFFSET) scales by 1 + w and rounds once."""
    normed = x * inv_rms
    if UNIT_OFFSET:
        w = w + 1.0
    else:
        normed = round_to_dtype(normed, IN_DTYPE)
    return round_to_dtype(normed * w, OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                     rows_per_group, x_group_stride, x_row_stride,
                     r_group_stride, r_row_stride, weight_stride, width, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    group = row // rows_per_group
    inner = row % rows_per_group
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    in_dtype: tl.constexpr = x_ptr.dtype.element_ty
    # The norm's weight is a model weight, never written by the kernel before: requested
    # before PDL's wait, it streams while that kernel drains (kernels/pdl.py). Read where
    # it lies, strided or not: a copy made by the wrapper would be that kernel.
    w = tl.load(weight_ptr + cols * weight_stride, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL)

    x = tl.load(x_ptr + group * x_group_stride + inner * x_row_stride + cols,
                mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + group * r_group_stride + inner * r_row_stride + cols,
                    mask=mask, other=0.0).to(tl.float32)
        x = round_to_dtype(x + r, in_dtype)
        tl.store(new_residual_ptr + row * width + cols, x.to(in_dtype), mask=mask)

    mean_square = tl.sum(x * x, axis=0) / width
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    out = scale_normalized(x, tl.math.rsqrt(mean_square + eps), w, in_dtype, out_dtype,
                           UNIT_OFFSET)
    tl.store(out_ptr + row * width + cols, out.to(out_dtype), mask=mask)


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., D] -> (x as a 2-D or 3-D view, rows_per_group, group_stride, row_stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    grouped = x.flatten(0, -3)  # a view when the leading dims are dense, else a copy
    return grouped, grouped.shape[1], grouped.stride(0), grouped.stride(1)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, unit_offset: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm_reference``; ``residual`` must have x's shape and dtype."""
    width = x.shape[-1]
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype,
                                                          device=x.device)
    if out.numel() == 0:
        return out, new_residual
    x_rows, rows_per_group, x_group_stride, x_row_stride = _row_layout(x)
    # Same shape as x, so the same rows_per_group; without a residual x stands in unread.
    r_rows, _, r_group_stride, r_row_stride = _row_layout(x if residual is None else residual)
    block = triton.next_power_of_2(width)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(out.numel() // width,)](
        x_rows, r_rows, weight, out, new_residual,
        rows_per_group, x_group_stride, x_row_stride, r_group_stride, r_row_stride,
        weight.stride(0), width, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        UNIT_OFFSET=unit_offset,
        PDL=pdl, num_warps=min(max(block // 256, 1), 16), **pdl_launch_options(pdl))
    return out, new_residual
