"""The torch linear routine (TORCH_MATMUL, and the cuBLAS side of TRITON_SKINNY_GEMM).

Every linear routine takes x in the model dtype. A weight kept in float32 in a 16-bit
model (DeepSeek's router: its logits must stay fp32) is the one mixed case: the result is
then float32, x(bf16) . W(fp32) computed as ``F.linear(x.float(), W)``. torch's GEMM needs
one dtype, so here x is converted first; the Triton GEMV converts it in its kernel
instead, where that saves the conversion's launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``F.linear``; a 16-bit x with a float32 weight is widened to float32 first."""
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        x = x.float()
    return F.linear(x, weight, bias)
