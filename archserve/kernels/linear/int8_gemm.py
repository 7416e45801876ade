"""W8A8 INT8 GEMM: activations quantized to int8 on the fly, an int8 tl.dot with int32
accumulation, both scales (and the bias) applied once in the fp32 epilogue.

Triton lowers an int8 tl.dot to tensor cores on SM80+ (mma.sync s8, Hopper wgmma s8) and
to MFMA i8 on CDNA GPUs (gfx90a, gfx942); on SM70/SM75 it fails to compile (Turing's
int8 mma shape is not one Triton emits), hence SM80+ on CUDA.

Activations round half to even, as the reference's torch.round (triton_int8_bits), so the
int8 operands equal ``quantize_activation_int8``'s exactly; the product differs from the
reference only by fp32 rounding order (exact int32 sums, then two scale multiplies).

At decode rows (up to W8A8_GEMV_ROWS) the start-up tuner also times the weight-only
kernel's GEMV reading the int8 weight with the activation quantization in its registers
(no quantization launch before it) against this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.linear.gemm_tiles import (
    ConfiguredRoutine,
    TileConfig,
    candidate_tiles,
    default_tile,
)
from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_TOKEN,
    ACT_STATIC_TENSOR,
    INT8_MAX,
    Int8Weight,
)
from archserve.kernels.linear.triton_gemm_tile import output_tile, store_output_tile
from archserve.kernels.linear.triton_int8_bits import int8_rounded
from archserve.kernels.linear.triton_row_scale import row_absmax_scale
from archserve.kernels.linear.triton_weight_only import (
    WeightOnlyConfig,
    w8a8_gemv_candidates,
    weight_only_gemm,
)

BLOCK_K = 128
_MAX: tl.constexpr = tl.constexpr(INT8_MAX)


@triton.jit
def _to_int8(v, scale):
    return int8_rounded(tl.math.div_rn(v, scale)).to(tl.int8)


@triton.jit
def _quantize_int8_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_xm, stride_qm,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: its scale to s[row] (the static one, or absmax / 127)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        scale = row_absmax_scale(x_row, K, _MAX, BLOCK)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + offs
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k, _to_int8(v, scale), mask=k < K)


def quantize_int8_activation(x: torch.Tensor, activation: str,
                             input_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]); the values of
    ``quantize_activation_int8`` (whose static scale is one [] tensor, here one per row)."""
    if activation not in (ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR):
        raise ValueError(f"no INT8 activation quantization for scheme {activation!r}")
    static = activation == ACT_STATIC_TENSOR
    if static and input_scale is None:
        raise ValueError("static activation quantization needs the weight's input_scale")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, depth = x.shape
    q = torch.empty((rows, depth), dtype=torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(depth))
    if rows:
        _quantize_int8_kernel[(rows,)](x, q, scale, input_scale if static else scale, depth,
                                       x.stride(0), q.stride(0), STATIC=static, BLOCK=block,
                                       num_warps=4 if block <= 1024 else 8)
    return q, scale


@triton.jit
def _int8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, M, N, K,
                      stride_am, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    sa = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    sw = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    store_output_tile(y_ptr, y, b_ptr, rows, cols, row_ok, col_ok, stride_ym, HAS_BIAS)


def int8_unsupported(x: torch.Tensor, weight: Int8Weight) -> str | None:
    """Why ``int8_gemm`` cannot take these operands, or None."""
    if weight.activation not in (ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR):
        return f"activation scheme {weight.activation}; expected per-token or per-tensor"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations are {x.dtype}"
    if weight.weight.stride(1) != 1:
        return "INT8 weight not contiguous along K"
    if weight.weight_scale.numel() != weight.out_features:
        return f"INT8 weight scales {tuple(weight.weight_scale.shape)}: expected one per row"
    return None


def default_config(rows: int, n: int) -> TileConfig:
    return default_tile(rows, n, BLOCK_K)


def candidate_configs(rows: int, n: int) -> list[TileConfig]:
    return candidate_tiles(rows, n, BLOCK_K)


def int8_gemm(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
              config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype. The caller checks ``int8_unsupported``."""
    rows, depth = x.shape
    cols = weight.out_features
    config = config or default_config(rows, cols)
    q, scale = quantize_int8_activation(x, weight.activation, weight.input_scale)
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    w_scale = weight.weight_scale.float().contiguous()
    grid = (triton.cdiv(cols, config.block_n), triton.cdiv(rows, config.block_m))
    _int8_gemm_kernel[grid](
        q, scale, weight.weight, w_scale, bias if bias is not None else y, y, rows, cols, depth,
        q.stride(0), weight.weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


class Int8Linear(ConfiguredRoutine):
    """The TRITON_INT8 routine. At decode rows its tuner also times the GEMV with the
    activation quantization in its registers (a WeightOnlyConfig)."""

    config_types = (TileConfig, WeightOnlyConfig)

    def run(self, x, weight, bias, config):  # noqa: ANN001, ANN201
        if isinstance(config, WeightOnlyConfig):
            return weight_only_gemm(x, weight, bias, config, w8a8=True)
        return int8_gemm(x, weight, bias, config)

    def candidates(self, rows: int, weight) -> list:  # noqa: ANN001
        return (candidate_configs(rows, weight.out_features)
                + w8a8_gemv_candidates(rows, weight))

