"""The precision every Triton kernel's tl.dot takes for its inputs' dtype (attention, MLA,
the skinny GEMM's tensor-core configs, LoRA): one rule, in a module each kernel family
imports without importing another's."""

from __future__ import annotations

import torch

from archserve.kernels.rules import triton_interpreted


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' tl.dot precision; "ieee" also makes them upcast the query to fp32.

    fp32 inputs get exact fp32 products (TF32 would lose ~3 digits against the reference).
    bf16 gets them too under the CPU interpreter only, whose bf16 tl.dot returns garbage
    (~1e10 off on a 16 x 16 product): upcast, the kernels' logic is still checked on CPU.
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and triton_interpreted()):
        return "ieee"
    return "tf32"
