"""The output tile of a tiled (tl.dot) GEMM program, and its epilogue.

The INT8, block-FP8 and weight-only MMA kernels share them: grid axis 0 walks N and axis 1
walks M, each program computes a [BLOCK_M, BLOCK_N] fp32 tile of y, adds the bias in fp32
and rounds once to y's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, cols, row_ok, col_ok): this program's rows and columns of y and which exist."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def store_output_tile(y_ptr, acc, b_ptr, rows, cols, row_ok, col_ok, stride_ym,
                      HAS_BIAS: tl.constexpr):
    """y[rows, cols] = acc (+ bias[cols], added in fp32), rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, round_to_dtype(acc, dtype).to(dtype), mask=row_ok[:, None] & col_ok[None, :])
