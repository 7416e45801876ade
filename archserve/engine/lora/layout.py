"""Where adapters go in a loaded model: the layers that take them, their slots, and an
adapter's matrices in those slots' layout.

Every dense linear the model loads from its checkpoint takes adapters (q/k/v, o, gate/up,
down, MLA's projections, shared experts kept as linears); a fused layer (q/k/v, gate/up)
takes each of its checkpoint matrices' adapters in its own block. An adapter for anything
else is refused with the reason: MoE experts (one fused kernel runs them all), the router,
matrices a layer reads itself (MLA's kv_b_proj), embeddings and the LM head.

Two facts of the loaded model enter an adapter's matrices when it is placed, once, on the
host: its scaling goes into B, and where the layer's input norm was folded into the layer
(models/layers/norm_folding.py: the layer now reads the row before the norm's weight) that
weight goes into A's columns, as it went into the layer's own matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from archserve.engine.lora.peft_adapter import PeftAdapter
from archserve.kernels.lora.interface import LoRASlots
from archserve.models.layers.linear import DenseMatrix, Linear

# One adapted layer's matrices on the host, in its slots' layout: A [S * R, K], B [N, R].
PlacedMatrices = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LoRATarget:
    """One linear that takes adapters, and the checkpoint modules of its blocks."""

    linear: Linear
    modules: list[str]                    # the checkpoint module of each block, in order
    input_scale: torch.Tensor | None      # a folded norm's weight its input lacks (float32)

    @property
    def slots(self) -> LoRASlots:
        return self.linear.lora


class LoRALayout:
    """The model's adapter-taking linears with their slots attached (``Linear.lora``)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.rank = max_lora_rank
        self.dtype = dtype
        by_layer: dict[int, LoRATarget] = {}
        scales = _folded_input_scales(model)
        for module, (linear, shard) in model.linear_checkpoint_modules().items():
            target = by_layer.get(id(linear))
            if target is None:
                target = by_layer[id(linear)] = LoRATarget(
                    linear, [""] * len(linear.shard_names), scales.get(id(linear.weight)))
            target.modules[linear.shard_names.index(shard)] = module
        self.targets = list(by_layer.values())
        self.by_module = {module: (i, block) for i, t in enumerate(self.targets)
                          for block, module in enumerate(t.modules)}
        for t in self.targets:
            t.linear.lora = LoRASlots.allocate(max_loras, max_lora_rank, t.linear.in_features,
                                               tuple(t.linear.shard_rows()), dtype, device)

    @property
    def slot_bytes(self) -> int:
        """Device memory of every layer's slots."""
        return sum(t.slots.a.numel() * t.slots.a.element_size()
                   + t.slots.b.numel() * t.slots.b.element_size() for t in self.targets)

    def place(self, adapter: PeftAdapter) -> dict[int, PlacedMatrices]:
        """The adapter's matrices by target index, in the slots' layout and dtype, scaled;
        ValueError naming each module it cannot place and why."""
        rename = getattr(self.model, "checkpoint_module_name", lambda name: name)
        found: dict[int, list[tuple[int, object]]] = {}
        problems = []
        for module, matrices in adapter.modules.items():
            placed = self.by_module.get(rename(module) or "")
            if placed is None:
                problems.append(f"{module} ({self._refusal(rename(module) or module)})")
                continue
            found.setdefault(placed[0], []).append((placed[1], matrices))
        if problems:
            raise ValueError(f"LoRA adapter {adapter.path!r} adapts modules this engine does "
                             f"not apply adapters to: {'; '.join(problems[:6])}"
                             + (f" ... ({len(problems)} in all)" if len(problems) > 6 else ""))
        return {index: self._matrices(self.targets[index], blocks, adapter.path)
                for index, blocks in found.items()}

    def _matrices(self, target: LoRATarget, blocks: list, path: str) -> PlacedMatrices:
        sizes = target.slots.slice_sizes
        rank = self.rank
        a = torch.zeros(len(sizes) * rank, target.linear.in_features)
        b = torch.zeros(sum(sizes), rank)
        for block, m in blocks:
            first = sum(sizes[:block])
            expected = ((m.rank, target.linear.in_features), (sizes[block], m.rank))
            if (tuple(m.a.shape), tuple(m.b.shape)) != expected:
                raise ValueError(
                    f"LoRA adapter {path!r}: {target.modules[block]} lora_A "
                    f"{tuple(m.a.shape)} / lora_B {tuple(m.b.shape)} do not fit this model's "
                    f"layer (expected {expected[0]} / {expected[1]}): an adapter of another "
                    f"base model?")
            down = m.a.float()
            if target.input_scale is not None:
                down = down * target.input_scale.to(down.device)
            a[block * rank:block * rank + m.rank] = down
            b[first:first + sizes[block], :m.rank] = m.b.float() * m.scaling
        return a.to(self.dtype), b.to(self.dtype)

    def _refusal(self, module: str) -> str:
        """Why ``module`` (a checkpoint name) takes no adapter here."""
        from archserve.models.layers.moe import FusedMoE, Router
        modules = dict(self.model.named_modules())
        parts = module.split(".")
        owners = [o for end in range(1, len(parts) + 1)
                  if (o := modules.get(".".join(parts[:end]))) is not None]
        if any(isinstance(o, FusedMoE) for o in owners):
            return "MoE experts take no LoRA adapters: one fused kernel runs them all"
        if ".shared_experts." in module and any(
                getattr(getattr(o, "experts", None), "num_shared_experts", 0) for o in owners):
            return ("these shared experts run stacked with the routed ones (fusion "
                    "shared_experts; ARCHSERVE_DISABLE_FUSIONS=shared_experts keeps them as "
                    "linears that take adapters)")
        owner = modules.get(module)
        if isinstance(owner, Router):
            return "the MoE router takes no LoRA adapters"
        if isinstance(owner, DenseMatrix):
            return "this matrix is read by its layer itself, not through a linear kernel"
        if owner is not None:
            return "only the decoder's linear layers take LoRA adapters"
        return "no such linear layer in this model"

    def load_slot(self, slot: int, placed: dict[int, PlacedMatrices]) -> None:
        """Copy an adapter's placed matrices into ``slot`` of every layer (zeros where it
        has none)."""
        for index, target in enumerate(self.targets):
            slots = target.slots
            matrices = placed.get(index)
            if matrices is None:
                slots.a[slot].zero_()
                slots.b[:, slot].zero_()
            else:
                slots.a[slot].copy_(matrices[0])
                slots.b[:, slot].copy_(matrices[1])


def _folded_input_scales(model: nn.Module) -> dict[int, torch.Tensor]:
    """id(weight) -> the folded norm weight that matrix absorbed, for every matrix that reads
    a folded norm's output (norm_folding.py: the block's ``input_matrices``)."""
    scales: dict[int, torch.Tensor] = {}
    for layer in model.modules():
        pairs = getattr(layer, "norms_and_readers", None)
        if pairs is None:
            continue
        for norm, block in pairs():
            if not getattr(norm, "folded", False) or norm.folded_weight is None:
                continue
            reader = getattr(block, "input_matrices", None)
            for matrix in (reader() if reader is not None else None) or ():
                scales[id(matrix)] = norm.folded_weight
    return scales
