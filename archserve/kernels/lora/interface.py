"""What a LoRA kernel computes, and the two things it reads: the adapters' slots of one
layer and the step's token-to-slot mapping.

Every layer that takes LoRA holds ``max_loras`` static slots (``LoRASlots``): loading an
adapter copies its matrices into one slot, so CUDA graphs captured once read whatever the
slots hold at replay. A layer of S fused checkpoint matrices (q/k/v: 3, gate/up: 2, else 1)
keeps, per slot, the S down-projections stacked (``a`` [L, S * R, K]) and the S
up-projections as row blocks of one matrix (``b`` [N, L, R], rows in the layer's output
order): token x of slot l adds ``(x A_s^T) B_s^T`` to output block s. Slots of a smaller
rank, or matrices an adapter leaves out, hold zeros. ``b`` is [N, L, R] rather than
[L, N, R] so that one output block of every slot is a plain [n, L * R] view (the torch
path multiplies all slots in one GEMM).

The step's mapping (``LoRAMapping``) is one int32 tensor: per slot its token count and the
start of its tokens in the sorted order, then per token (slot, token of the sorted order)
pairs. The grouped kernels walk each slot's tokens through the sorted order (punica's SGMV:
no row moves); the torch path reads each token's slot. Its views have fixed offsets in a
buffer the engine keeps for the life of the runner, so graphs read each step's mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

NO_SLOT = -1     # a token that takes no adapter


@dataclass(frozen=True)
class LoRASlots:
    """One layer's adapter slots (see the module doc)."""

    a: torch.Tensor                  # [L, S * R, K], model dtype
    b: torch.Tensor                  # [N, L, R], model dtype
    slice_sizes: tuple[int, ...]     # the output rows of each of the S blocks, in order

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def rank(self) -> int:
        return self.b.shape[2]

    @property
    def num_slices(self) -> int:
        return len(self.slice_sizes)

    @staticmethod
    def allocate(num_slots: int, rank: int, in_features: int, slice_sizes: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str) -> LoRASlots:
        """Zeroed slots: a slot that holds no adapter adds nothing."""
        a = torch.zeros(num_slots, len(slice_sizes) * rank, in_features, dtype=dtype,
                        device=device)
        b = torch.zeros(sum(slice_sizes), num_slots, rank, dtype=dtype, device=device)
        return LoRASlots(a, b, tuple(slice_sizes))


@dataclass(frozen=True)
class LoRAMapping:
    """Views of one packed int32 mapping for a step of ``num_tokens`` tokens."""

    slot_counts: torch.Tensor        # [L]: tokens of each slot
    slot_starts: torch.Tensor        # [L]: where each slot's tokens start in the sorted order
    token_slots: torch.Tensor        # [T] (stride 2): each token's slot, NO_SLOT for none
    sorted_tokens: torch.Tensor      # [T] (stride 2): the tokens grouped by slot
    packed: torch.Tensor             # the whole int32 buffer the views are of

    @property
    def num_slots(self) -> int:
        return self.slot_counts.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @staticmethod
    def views(packed: torch.Tensor, num_slots: int, num_tokens: int) -> LoRAMapping:
        """The mapping of the first ``num_tokens`` tokens held in ``packed`` (laid out by
        ``pack_mapping``; it may hold more tokens)."""
        pairs = packed[2 * num_slots:2 * num_slots + 2 * num_tokens].view(num_tokens, 2)
        return LoRAMapping(packed[:num_slots], packed[num_slots:2 * num_slots],
                           pairs[:, 0], pairs[:, 1], packed)


@dataclass(frozen=True)
class ShrinkNorm:
    """The RMSNorm before a layer whose base GEMM normalises its input in its prologue: a
    shrink that runs before that GEMM normalises the input the same way."""

    residual: torch.Tensor | None     # added to x first (the norm's residual input)
    weight: torch.Tensor | None       # None: folded into the layer's weights (and A)
    eps: float


def packed_size(num_slots: int, num_tokens: int) -> int:
    """int32 elements of a packed mapping of ``num_tokens`` tokens."""
    return 2 * num_slots + 2 * num_tokens


def pack_mapping(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """The packed int32 mapping of a step whose token i takes slot ``token_slots[i]``
    (NO_SLOT: none): slot counts, slot starts, then (slot, sorted token) pairs."""
    slots = np.asarray(token_slots, dtype=np.int32)
    out = np.empty(packed_size(num_slots, slots.shape[0]), dtype=np.int32)
    taking = slots >= 0
    counts = np.bincount(slots[taking], minlength=num_slots)[:num_slots]
    out[:num_slots] = counts
    out[num_slots] = 0
    np.cumsum(counts[:-1], out=out[num_slots + 1:2 * num_slots])
    pairs = out[2 * num_slots:].reshape(-1, 2)
    pairs[:, 0] = slots
    # Tokens of slot 0 first, then slot 1...; those without an adapter last (never read).
    order = np.argsort(np.where(taking, slots, num_slots), kind="stable")
    pairs[:, 1] = order
    return out


class LoRAImpl(Protocol):
    """A LoRA backend's computation (kernels/lora/rules.py builds it). A backend may also
    provide ``expand_epilogue(x, slots, mapping, norm=None)``: it launches the shrink of x
    (of rms_norm(x + residual) with a ``ShrinkNorm``) and returns what a base GEMM's
    epilogue reads to add the delta itself, or None where it declines; and
    ``add_lora_silu_mul(y, x, slots, mapping)``: silu(gate) * up of a gate/up
    layer's output y [T, 2I] with the delta added to gate and up first, or None where it
    declines (models/layers/linear.py then adds the delta and runs the SiLU kernel)."""

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                 mapping: LoRAMapping) -> None:
        """y[t, block s] += (x[t] A_s^T) B_s^T for every token t with a slot, in place
        (y: the layer's output [T, N]; x: its input [T, K])."""
