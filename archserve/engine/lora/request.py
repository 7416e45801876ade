"""``LoRARequest``: which adapter a request runs with, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class LoRARequest:
    """An adapter by name, a globally unique id (>= 1) and the PEFT directory it loads from:
    ``LoRARequest("sql", 1, "/adapters/sql")``. Requests with the same id share one loaded
    adapter. Equal (and hashed) by name, as vLLM's."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("a LoRA request needs a name")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
