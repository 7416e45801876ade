"""A runner's LoRA state for the step: the adapters' slots, the kernel, and the step's
token-to-slot mapping in a device buffer kept for the runner's life.

Every forward reads its mapping from that one buffer (``mapping``), so graphs captured once
read the mapping of the step they replay for; a step's mapping travels to the device with
the batch and is copied into the buffer before the forward (``load``). The buffer holds
the largest step's tokens; rows a graph runs past a step keep earlier steps' slots, whose
outputs are dropped with the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from archserve.engine.lora.manager import LoRAManager
from archserve.kernels.lora.interface import (
    NO_SLOT,
    LoRAImpl,
    LoRAMapping,
    pack_mapping,
    packed_size,
)


class LoRAStep:
    def __init__(self, manager: LoRAManager, impl: LoRAImpl, max_tokens: int,
                 device: torch.device) -> None:
        self.manager = manager
        self.impl = impl
        self.num_slots = manager.max_loras
        self.max_tokens = max_tokens
        self.buffer = torch.zeros(packed_size(self.num_slots, max_tokens), dtype=torch.int32,
                                  device=device)
        self.buffer[2 * self.num_slots::2].fill_(NO_SLOT)
        self._views: dict[int, LoRAMapping] = {}

    def pack(self, seqs: Sequence, num_tokens: Sequence[int]) -> tuple[np.ndarray, bool]:
        """(the packed mapping of a step whose i-th sequence runs ``num_tokens[i]`` tokens,
        with the adapter each holds in ``seq.lora``; whether any token takes one). Copies
        the step's adapters into slots first where they hold none."""
        adapters = [s.lora for s in seqs]
        slots = np.asarray(self.manager.slots_for(adapters), dtype=np.int32)
        total = int(sum(num_tokens))
        if total > self.max_tokens:
            raise RuntimeError(f"a step of {total} tokens, above the LoRA mapping's "
                               f"{self.max_tokens}")
        return pack_mapping(np.repeat(slots, num_tokens), self.num_slots), bool(
            (slots != NO_SLOT).any())

    def load(self, packed: torch.Tensor) -> None:
        """Copy a step's packed mapping (on the device) into the buffer."""
        self.buffer[:packed.numel()].copy_(packed, non_blocking=True)

    def mapping(self, num_tokens: int) -> LoRAMapping:
        """The buffer's mapping of a forward over ``num_tokens`` rows."""
        view = self._views.get(num_tokens)
        if view is None:
            if num_tokens > self.max_tokens:
                raise RuntimeError(f"a forward of {num_tokens} tokens, above the LoRA "
                                   f"mapping's {self.max_tokens}")
            view = self._views[num_tokens] = LoRAMapping.views(self.buffer, self.num_slots,
                                                               num_tokens)
        return view
