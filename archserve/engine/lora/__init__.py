"""LoRA adapters over one base model: requests (vLLM's ``LoRARequest``), reading PEFT
adapter directories, the per-layer slots and the host and GPU caches, the step's mapping."""

from archserve.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
