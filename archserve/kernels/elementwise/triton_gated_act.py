"""act(gate) * up in Triton: x [T, 2I] (gate first, as GateUpLinear stores) -> [T, I], for
the two gated MLPs archserve runs: SiLU (SwiGLU: Llama, Qwen) and GELU with the tanh
approximation (GeGLU: Gemma).

Like the references (and torch's own kernels), act(gate) is computed in fp32 and rounded
to the activations' dtype before the multiply by up. GELU-tanh is
0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))); Triton has no portable tanh
(libdevice's is per backend and absent from the interpreter), so tanh(y) is
2 * sigmoid(2y) - 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype

_BLOCK = 1024
SILU: tl.constexpr = tl.constexpr(0)
GELU_TANH: tl.constexpr = tl.constexpr(1)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_KAPPA = tl.constexpr(0.044715)


@triton.jit
def gated_product(gate, up, dtype: tl.constexpr, ACT: tl.constexpr = SILU):
    """act(gate) * up from fp32 gate and up, rounded to ``dtype`` where the references round:
    act(gate), then the product. Shared by every kernel that fuses the gated activation."""
    if ACT == SILU:
        activated = gate * tl.sigmoid(gate)
    else:
        inner = _SQRT_2_OVER_PI * (gate + _KAPPA * (gate * gate * gate))
        activated = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    return round_to_dtype(round_to_dtype(activated, dtype) * up, dtype)


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, x_stride, width, ACT: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * width + cols, gated_product(gate, up, dtype, ACT).to(dtype),
             mask=mask)


def _gated_act(x: torch.Tensor, act: int) -> torch.Tensor:
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, 2 * width)  # a view for any output of a linear layer
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(width))
    grid = (rows.shape[0], triton.cdiv(width, block))
    _gated_act_kernel[grid](rows, out, rows.stride(0), width, ACT=act, BLOCK=block,
                            num_warps=min(max(block // 256, 1), 4))
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_reference``; x's rows may be strided."""
    return _gated_act(x, SILU)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``gelu_tanh_and_mul_reference``; x's rows may be strided."""
    return _gated_act(x, GELU_TANH)
