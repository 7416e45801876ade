"""Start-up of LoRA serving: the backend, the layers' slots, the caches, the route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.engine.lora.layout import LoRALayout
from archserve.engine.lora.manager import LoRAManager
from archserve.engine.lora.step import LoRAStep
from archserve.kernels.catalog import select_lora_backend
from archserve.kernels.registry import Selection
from archserve.kernels.specs import LoRASpec
from archserve.platform.decision import Decision
from archserve.platform.device import DeviceInfo

if TYPE_CHECKING:
    from archserve.engine.config import EngineConfig


@dataclass
class LoRASetup:
    manager: LoRAManager
    selection: Selection
    impl: object
    decision: Decision
    route: object                 # the explain Route of the selection
    graphs_off: str | None        # why CUDA graphs cannot hold the backend, if they cannot

    def step(self, max_tokens: int, device: torch.device) -> LoRAStep:
        """The runner's per-step state, for steps of at most ``max_tokens`` tokens."""
        return LoRAStep(self.manager, self.impl, max_tokens, device)


def lora_spec(config: EngineConfig, dtype: torch.dtype) -> LoRASpec:
    return LoRASpec(dtype=dtype, max_loras=config.max_loras,
                    max_lora_rank=config.max_lora_rank)


def setup_lora(config: EngineConfig, model: nn.Module, device: DeviceInfo,
               torch_device: torch.device, dtype: torch.dtype) -> LoRASetup | None:
    """Select the LoRA backend and give every adapter-taking linear its slots (device
    memory: allocated before the KV cache is sized); None without ``enable_lora``."""
    if not config.enable_lora:
        return None
    from archserve.routing.explain import route_from_selection
    spec = lora_spec(config, dtype)
    selection = select_lora_backend(device, spec)
    impl = selection.backend.make_impl(device, spec)
    layout = LoRALayout(model, config.max_loras, config.max_lora_rank, dtype, torch_device)
    if not layout.targets:
        raise ValueError("enable_lora: this model has no linear layer that takes LoRA adapters")
    cpu_loras = config.max_cpu_loras or config.max_loras
    manager = LoRAManager(layout, config.max_loras, cpu_loras, config.max_lora_rank)
    decision = Decision(
        "lora", f"max_loras={config.max_loras}, max_lora_rank={config.max_lora_rank}",
        selection.name,
        f"{len(layout.targets)} linear layers hold {config.max_loras} adapter slot(s) each "
        f"({layout.slot_bytes / 2**20:.1f} MiB); the host keeps up to {cpu_loras} adapters")
    graphs_off = (None if selection.backend.graph_capturable else
                  f"the LoRA backend {selection.name} cannot be captured in a CUDA graph")
    return LoRASetup(manager, selection, impl, decision,
                     route_from_selection(selection, "lora (adapters)", device, spec),
                     graphs_off)
