"""LoRA backends (op ``lora``): the delta every adapter-serving linear adds, and its order.

TRITON_LORA groups a step's tokens by adapter slot (punica's SGMV: shrink, then expand into
the layer's output) on any CUDA or ROCm GPU, and on NVIDIA SM90+ launches both kernels with
PDL; TORCH_LORA multiplies every slot for every token and masks (kernels/lora/torch_lora.py)
on any device. Both read only device tensors, so CUDA graphs capture either.
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import (
    RuleBackend,
    bf16_on_device,
    needs_dtype,
    needs_triton_device,
)
from archserve.kernels.specs import LoRASpec
from archserve.platform.capability import SM90
from archserve.platform.device import DeviceInfo

_IMPL = "archserve.kernels.lora"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonLoRABackend(RuleBackend):
    name = "TRITON_LORA"
    op = "lora"
    library = "triton"
    graph_capturable = True
    mixed_graph_capturable = True
    description = ("Triton shrink/expand over the batch's tokens grouped by adapter "
                   "(punica's SGMV; any CUDA or ROCm GPU)")
    impl_path = f"{_IMPL}.triton_lora:TritonLoRA"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_triton_device(device)

    def request_rule(self, device: DeviceInfo, spec: LoRASpec) -> str | None:
        return (needs_dtype(spec.dtype, _DTYPES)
                or (bf16_on_device(device, spec.dtype) if device.is_gpu else None))

    def detail(self, device: DeviceInfo, spec: LoRASpec) -> str:
        if device.is_cuda and device.has_capability(SM90):
            return "PDL launches"
        return ""


class TorchLoRABackend(RuleBackend):
    name = "TORCH_LORA"
    op = "lora"
    graph_capturable = True
    mixed_graph_capturable = True
    description = ("torch: every adapter slot for every token, masked by the token's slot "
                   "(any device; its work grows with max_loras)")
    impl_path = f"{_IMPL}.torch_lora:TorchLoRA"

    def request_rule(self, device: DeviceInfo, spec: LoRASpec) -> str | None:
        return needs_dtype(spec.dtype, _DTYPES)


LORA_BACKENDS: tuple[type[RuleBackend], ...] = (TritonLoRABackend, TorchLoRABackend)
LORA_FALLBACK = TorchLoRABackend.name


def lora_priority(device: DeviceInfo, spec: LoRASpec) -> list[str]:
    """The grouped Triton kernels on GPUs (vLLM's punica kernels are Triton there too);
    torch elsewhere."""
    return ["TRITON_LORA", "TORCH_LORA"] if device.is_gpu else ["TORCH_LORA"]
