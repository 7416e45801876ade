"""Each rank's device memory after start-up, beside its KV pool and weights.

The KV pool is sized at start-up to fill the device's share (``gpu_memory_utilization``)
that the weights, the activation peak and the CUDA-graph reserve leave. What is still
free once start-up is over tells whether it did: the share minus the memory in use is
about zero when the pool took what it was given, well above zero when the pool is
smaller than the memory allows, below zero when start-up took more than its share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = float(1 << 30)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RankMemory:
    kv_pool_bytes: int
    weight_bytes: int
    total_bytes: int | None = None   # the GPU's memory; None on a CPU (a fixed KV budget)
    free_bytes: int | None = None    # free on the GPU after start-up

    def budget_left_bytes(self, utilization: float) -> int | None:
        """The engine's share of the GPU minus what is in use after start-up."""
        if self.total_bytes is None or self.free_bytes is None:
            return None
        return int(self.total_bytes * utilization - (self.total_bytes - self.free_bytes))


def measure_rank_memory(device: torch.device, kv_pool_bytes: int, model: torch.nn.Module
                        ) -> RankMemory:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type != "cuda":
        return RankMemory(kv_pool_bytes, weights)
    free, total = torch.cuda.mem_get_info(device)
    return RankMemory(kv_pool_bytes, weights, total, free)


def describe_rank_memory(memories: list[RankMemory], utilization: float) -> str:
    """One clause per rank: its KV pool and weights, and on a GPU what is left."""
    parts = []
    for rank, m in enumerate(memories):
        text = f"rank {rank}: KV pool {_size(m.kv_pool_bytes)}, weights {_size(m.weight_bytes)}"
        left = m.budget_left_bytes(utilization)
        if left is not None:
            text += (f", {_size(m.free_bytes)} free of {_size(m.total_bytes)} ("
                     f"{'+' if left >= 0 else '-'}{_size(abs(left))} of the {utilization:g} "
                     f"share unused)")
        parts.append(text)
    return "; ".join(parts)
