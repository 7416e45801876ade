"""W8A8 FP8 GEMMs: activations quantized to e4m3 on the fly, FP8 tensor cores (SM89+).

* Per-channel (or per-tensor, stored per channel) weight scales: ``scaled_mm_fp8``
  quantizes x in one Triton launch (dynamic per token, or the static per-tensor scale
  written per row) and calls ``torch._scaled_mm`` with row-wise scales: scale_a [M, 1]
  and scale_b [1, N] fp32. On an H200 with torch 2.11 that accepts bf16, fp16 and fp32
  outputs, a bias with bf16/fp16 outputs only (so an fp32 output adds it afterwards),
  a scalar scale only when both are scalars (hence the static scale written per row),
  and K and N divisible by 16 (any M). Where a build rejects row-wise scales,
  ``rowwise=False`` multiplies with unit tensor-wise scales into fp32 and applies both
  scales and the bias in torch: slower, the same values.
* 128x128 block scales with activations scaled per token per 128 channels (DeepSeek-V3
  style): ``block_fp8_gemm``, a Triton kernel with tl.float8e4nv operands that applies
  both scales to each 128-deep partial product in fp32.

The activation quantization matches ``quantize_activation_fp8`` bit for bit: correctly
rounded divisions (``div_rn``; Triton's ``/`` is approximate) and e4m3 rounding by
integer operations (triton_fp8_bits), which also lets the CPU interpreter check it. That
is the reference as the CPU evaluates it: torch on CUDA divides by a Python number
(``absmax / FP8_MAX``) as a multiply by its fp32 reciprocal, so reference_linear run on a
GPU has some scales an ulp away from these (seen on an H200, torch 2.11).
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
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_STATIC_TENSOR,
    FP8_DTYPE,
    FP8_MAX,
    MIN_ACTIVATION_SCALE,
    Fp8Weight,
)
from archserve.kernels.linear.triton_fp8_bits import fp32_to_e4m3_bits
from archserve.kernels.linear.triton_gemm_tile import output_tile, store_output_tile
from archserve.kernels.linear.triton_row_scale import row_absmax_scale
from archserve.kernels.linear.triton_weight_only import (
    DENSE_CONFIG,
    WeightOnlyConfig,
    w8a8_gemv_candidates,
    weight_only_gemm,
)

GROUP = 128      # activation channels per dynamic group scale (= the weight block's K)
# TORCH_SCALED_MM's default config: not a Triton launch, the library GEMM (as the
# weight-only routine's DENSE_CONFIG is its dequantize-then-cuBLAS path).
SCALED_MM = DENSE_CONFIG
_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_MIN_SCALE: tl.constexpr = tl.constexpr(MIN_ACTIVATION_SCALE)
_TOKEN: tl.constexpr = tl.constexpr(0)
_STATIC: tl.constexpr = tl.constexpr(1)
_GROUP: tl.constexpr = tl.constexpr(2)
_MODES = {ACT_DYNAMIC_TOKEN: 0, ACT_STATIC_TENSOR: 1, ACT_DYNAMIC_GROUP: 2}


@triton.jit
def _to_e4m3(v, scale):
    return fp32_to_e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -_MAX), _MAX))


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_xm, stride_qm,
                         stride_sm, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program (``_GROUP``: one row's group ``pid(1)``, BLOCK == its size).
    q is the uint8 view of the fp8 output; s gets the row's (or group's) fp32 scale."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK)
    if MODE == _GROUP:
        k = tl.program_id(1) * BLOCK + offs
        v = tl.load(x_row + k).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), _MAX), _MIN_SCALE)
        tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)
        tl.store(q_row + k, _to_e4m3(v, scale))
    else:
        if MODE == _STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            scale = row_absmax_scale(x_row, K, _MAX, BLOCK)
        tl.store(s_ptr + row * stride_sm, scale)
        for k0 in range(0, K, BLOCK):
            k = k0 + offs
            v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            tl.store(q_row + k, _to_e4m3(v, scale), mask=k < K)


def quantize_fp8_activation(x: torch.Tensor, activation: str,
                            input_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1], or [M, K/128] per group). A static
    per-tensor scale is written once per row (what row-wise _scaled_mm takes); otherwise
    the values equal ``quantize_activation_fp8``'s."""
    if activation not in _MODES:
        raise ValueError(f"no FP8 activation quantization for scheme {activation!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, depth = x.shape
    q = torch.empty((rows, depth), dtype=FP8_DTYPE, device=x.device)
    mode = _MODES[activation]
    if mode == 2:
        if depth % GROUP:
            raise ValueError(f"per-group activation scales need K divisible by {GROUP}, "
                             f"K is {depth}")
        scale = torch.empty((rows, depth // GROUP), dtype=torch.float32, device=x.device)
        grid, block = (rows, depth // GROUP), GROUP
    else:
        if mode == 1 and input_scale is None:
            raise ValueError("static activation quantization needs the weight's input_scale")
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        grid, block = (rows,), min(4096, triton.next_power_of_2(depth))
    if rows:
        _quantize_fp8_kernel[grid](
            x, q.view(torch.uint8), scale, input_scale if mode == 1 else scale, depth,
            x.stride(0), q.stride(0), scale.stride(0), MODE=mode, BLOCK=block,
            num_warps=4 if block <= 1024 else 8)
    return q, scale


# ---- per-channel weights: torch._scaled_mm -------------------------------------------------

def scaled_mm_unsupported(x: torch.Tensor, weight: Fp8Weight) -> str | None:
    """Why ``scaled_mm_fp8`` cannot take these operands, or None."""
    if weight.block is not None:
        return "block-scaled weights (TRITON_BLOCK_FP8 runs those)"
    if weight.activation not in (ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR):
        return f"activation scheme {weight.activation}; expected per-token or per-tensor"
    if weight.in_features % 16 or weight.out_features % 16:
        return (f"torch._scaled_mm needs K and N divisible by 16, the weight is "
                f"{weight.out_features}x{weight.in_features}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations are {x.dtype}"
    if weight.weight.stride(1) != 1:
        return "FP8 weight not contiguous along K"
    return None


def scaled_mm_fp8(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                  rowwise: bool = True) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype through torch._scaled_mm (see the module note)."""
    q, scale_a = quantize_fp8_activation(x, weight.activation, weight.input_scale)
    n = weight.out_features
    scale_b = weight.weight_scale.float().reshape(1, -1)
    if scale_b.shape[1] != n:                                # one scale for the tensor
        scale_b = scale_b.expand(1, n).contiguous()
    if not rowwise:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(q, weight.weight.t(), scale_a=one, scale_b=one,
                             out_dtype=torch.float32)
        y = y * scale_a * scale_b
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    fused = bias is not None and x.dtype != torch.float32
    y = torch._scaled_mm(q, weight.weight.t(), scale_a=scale_a, scale_b=scale_b,
                         bias=bias.to(x.dtype) if fused else None, out_dtype=x.dtype)
    if bias is not None and not fused:
        y = y + bias
    return y


def rowwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether this build's torch._scaled_mm takes row-wise scales on ``device`` (run
    once, eagerly, when the routine is built)."""
    a = torch.zeros((16, 16), dtype=FP8_DTYPE, device=device)
    ones = torch.ones((16, 1), dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class ScaledMmFp8Linear(ConfiguredRoutine):
    """The TORCH_SCALED_MM routine: ``routine(x, weight, bias)`` for x [..., K].

    At decode rows (up to W8A8_GEMV_ROWS) the start-up tuner also times the FP8 GEMV with
    the activations quantized in its registers (one launch: no quantization kernel before
    the GEMM; the weight streamed once on the CUDA cores) against the default,
    quantize-then-torch._scaled_mm (SCALED_MM); it is installed only where it timed
    faster and agreed."""

    config_type = WeightOnlyConfig

    def __init__(self, device=None, spec=None) -> None:
        super().__init__(device, spec)
        self.rowwise = (rowwise_scaled_mm_works(torch.device("cuda"))
                        if torch.cuda.is_available() else True)

    def run(self, x, weight, bias, config):  # noqa: ANN001, ANN201
        if config is None or not config.gemv:
            return scaled_mm_fp8(x, weight, bias, self.rowwise)
        return weight_only_gemm(x, weight, bias, config, w8a8=True)

    def candidates(self, rows: int, weight) -> list:  # noqa: ANN001
        gemvs = w8a8_gemv_candidates(rows, weight)
        return [SCALED_MM] + gemvs if gemvs else []


# ---- 128x128 block weights: Triton ---------------------------------------------------------

@triton.jit
def _block_fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, M, N, K,
                           stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                           HAS_BIAS: tl.constexpr, GROUP_K: tl.constexpr,
                           SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = sum over K tiles of (a_tile . w_tile) * a_scale[row, group] * w_scale[col block,
    group], with BLOCK_K dividing GROUP_K (the activation group = the weight block's K)."""
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_asm
    w_scales = w_scale_ptr + (cols // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        t = tl.dot(a, b)
        sa = tl.load(a_scales + k0 // GROUP_K, mask=row_ok, other=0.0)
        sw = tl.load(w_scales + k0 // GROUP_K, mask=col_ok, other=0.0)
        acc += t * sa[:, None] * sw[None, :]
    store_output_tile(y_ptr, acc, b_ptr, rows, cols, row_ok, col_ok, stride_ym, HAS_BIAS)


def block_fp8_unsupported(x: torch.Tensor, weight: Fp8Weight) -> str | None:
    """Why ``block_fp8_gemm`` cannot take these operands, or None."""
    if weight.block is None or weight.block[1] != GROUP:
        return f"needs {GROUP}-deep weight scale blocks, the weight has {weight.block}"
    if weight.activation != ACT_DYNAMIC_GROUP:
        return f"activation scheme {weight.activation}; expected per-token-per-{GROUP}-group"
    if weight.in_features % GROUP:
        return f"K {weight.in_features} is not a multiple of {GROUP}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations are {x.dtype}"
    if weight.weight.stride(1) != 1:
        return "FP8 weight not contiguous along K"
    return None


def default_config(rows: int, n: int) -> TileConfig:
    return default_tile(rows, n, GROUP)


def candidate_configs(rows: int, n: int) -> list[TileConfig]:
    return candidate_tiles(rows, n, GROUP)


def block_fp8_gemm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                   config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; weight with (bn, 128) block scales and dynamic
    per-token-per-128-group activations. The caller checks ``block_fp8_unsupported``."""
    rows, depth = x.shape
    cols = weight.out_features
    config = config or default_config(rows, cols)
    q, scale = quantize_fp8_activation(x, ACT_DYNAMIC_GROUP)
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    w_scale = weight.weight_scale.float().contiguous()
    grid = (triton.cdiv(cols, config.block_n), triton.cdiv(rows, config.block_m))
    _block_fp8_gemm_kernel[grid](
        q, scale, weight.weight, w_scale, bias if bias is not None else y, y, rows, cols, depth,
        q.stride(0), scale.stride(0), weight.weight.stride(0), w_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GROUP_K=GROUP, SCALE_BLOCK_N=weight.block[0],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


class BlockFp8Linear(ConfiguredRoutine):
    """The TRITON_BLOCK_FP8 routine. At decode rows its tuner also times the FP8 GEMV with
    the per-128-group activation quantization in its registers (a WeightOnlyConfig)."""

    config_types = (TileConfig, WeightOnlyConfig)

    def run(self, x, weight, bias, config):  # noqa: ANN001, ANN201
        if isinstance(config, WeightOnlyConfig):
            return weight_only_gemm(x, weight, bias, config, w8a8=True)
        return block_fp8_gemm(x, weight, bias, config)

    def candidates(self, rows: int, weight) -> list:  # noqa: ANN001
        return (candidate_configs(rows, weight.out_features)
                + w8a8_gemv_candidates(rows, weight))

