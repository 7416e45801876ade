"""The LoRA delta token by token: what every LoRA implementation is tested against."""

from __future__ import annotations

import torch

from archserve.kernels.lora.interface import LoRAMapping, LoRASlots


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                       mapping: LoRAMapping) -> None:
    """For each token with a slot and each output block s: y += (x A_s^T) B_s^T, in
    float32, rounded once to y's dtype."""
    rank = slots.rank
    for token, slot in enumerate(mapping.token_slots.tolist()):
        if slot < 0:
            continue
        first = 0
        for s, size in enumerate(slots.slice_sizes):
            down = slots.a[slot, s * rank:(s + 1) * rank].float()      # [R, K]
            up = slots.b[first:first + size, slot].float()              # [n, R]
            delta = up @ (down @ x[token].float())
            y[token, first:first + size] = (y[token, first:first + size].float()
                                            + delta).to(y.dtype)
            first += size
