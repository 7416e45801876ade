"""TORCH_LORA: the LoRA delta in torch, on any device, inside CUDA graphs too.

Every slot is multiplied for every token, and the products of slots a token does not take
are zeroed before the up-projection: two GEMMs per output block and no host value read, so
a captured graph stays right whatever the step's mapping. The cost grows with the number of
slots (``max_loras`` times a grouped kernel's work), which is small beside the layer's own
GEMM at CPU batch sizes: rank 16 of 4,096 channels is 0.4% of it per slot.
"""

from __future__ import annotations

import torch

from archserve.kernels.lora.interface import LoRAMapping, LoRASlots


class TorchLoRA:
    def __init__(self, device=None, spec=None) -> None:  # noqa: ANN001 - registry signature
        pass

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                 mapping: LoRAMapping) -> None:
        num_tokens = x.shape[0]
        num_slots, rank, width = slots.num_slots, slots.rank, slots.a.shape[1]
        token_slots = mapping.token_slots[:num_tokens]
        taken = token_slots[:, None] == torch.arange(num_slots, device=x.device)[None, :]
        down = x @ slots.a.view(num_slots * width, -1).t()              # [T, L * S * R]
        down = down.view(num_tokens, num_slots, width) * taken[:, :, None].to(down.dtype)
        down = down.view(num_tokens, num_slots, slots.num_slices, rank)
        first = 0
        for s, size in enumerate(slots.slice_sizes):
            up = slots.b[first:first + size].view(size, num_slots * rank)
            y[:, first:first + size] += down[:, :, s].reshape(num_tokens, -1) @ up.t()
            first += size
