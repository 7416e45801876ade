"""The precision every Triton kernel's tl.dot takes for its inputs' dtype (attention, MLA,
the skinny GEMM's tensor-core configs, LoRA): one rule, in a module each kernel family
imports without importing another's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from archserve.kernels.rules import triton_interpreted
from archserve.platform.capability import SM80

if TYPE_CHECKING:
    from archserve.platform.device import DeviceInfo


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' tl.dot precision; "ieee" also makes them upcast the query to fp32.

    fp32 inputs get exact fp32 products (TF32 would lose ~3 digits against the reference).
    bf16 gets them too under the CPU interpreter only, whose bf16 tl.dot returns garbage
    (~1e10 off on a 16 x 16 product): upcast, the kernels' logic is still checked on CPU.
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and triton_interpreted()):
        return "ieee"
    return "tf32"


def dot_has_tensor_cores(device: DeviceInfo) -> bool:
    """Whether Triton lowers a 16-bit tl.dot to tensor-core instructions on ``device``.
    Not on CUDA below SM80: Triton (3.6 and 3.9 alike) emits no mma.sync for SM70/SM75 but
    FMA loops over operands widened to fp32 in registers, so a V100's or a T4's tl.dot runs
    on CUDA cores and large tiles spill (kernels/attention/triton_prefill.py). Other GPUs
    (ROCm, XPU) are taken to have them: CUDA's gap is the one known."""
    if device.platform != "cuda":
        return device.is_gpu
    return device.capability is not None and device.capability >= SM80
