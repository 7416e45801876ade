"""The routed experts of one layer, quantized: the dense linears' layouts with an expert axis.

A layer's experts are two stacked weights, as for 16-bit experts (``w13`` [E, 2I, H]: each
expert's gate rows then its up rows; ``w2`` [E, H, I]), each held in one of the quantized
layouts every quantized kernel reads (kernels/linear/quantized_weights.py), with every
tensor given a leading expert dimension:

* ``Fp8Weight``: weight [E, N, K] e4m3; weight_scale [E, N] per channel (per-tensor
  scales are stored per channel, as for dense layers) or [E, ceil(N/bn), ceil(K/bk)]
  blocks; one input_scale [] for the layer (static activations: the largest expert's, as
  vLLM takes it), since a token's activations are quantized once for all its experts.
* ``IntGroupWeight``: qweight int32 [E, K/pack, N]; scales and offsets [E, K/group, N].
* ``Mxfp4Weight``: blocks uint8 [E, N, K/2]; scales (e8m0) [E, N, K/32].

``expert_weight`` cuts expert e back out as a plain 2-D weight, so the reference
arithmetic (``reference_linear``, ``dequantize``) and the loaders' repacking are the dense
layers' own, applied per expert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from archserve.kernels.linear import formats as fmt
from archserve.kernels.linear.quantized_weights import (
    ACT_NONE,
    Fp8Weight,
    IntGroupWeight,
    Mxfp4Weight,
    QuantizedWeight,
)

ExpertWeight = Fp8Weight | IntGroupWeight | Mxfp4Weight
# Fields one value of which serves every expert (not stacked).
_SHARED = ("input_scale",)


@dataclass
class QuantizedExperts:
    w13: ExpertWeight
    w2: ExpertWeight

    @property
    def num_experts(self) -> int:
        return expert_tensor(self.w13).shape[0]

    @property
    def weight_format(self) -> str:
        """The kernel vocabulary of kernels/linear/formats.py (fp8, fp8_block, wna16,
        mxfp4)."""
        if isinstance(self.w13, IntGroupWeight):
            return fmt.WNA16
        if isinstance(self.w13, Mxfp4Weight):
            return fmt.MXFP4
        return fmt.FP8_BLOCK if self.w13.block is not None else fmt.FP8

    @property
    def activation(self) -> str:
        return getattr(self.w13, "activation", ACT_NONE)


def expert_shape(w: ExpertWeight) -> tuple[int, int]:
    """(N, K) of each expert's matrix (the dense layouts' in/out_features read a 2-D
    weight, not the stacked one)."""
    if isinstance(w, IntGroupWeight | Mxfp4Weight):
        return w.out_features, w.in_features
    return w.weight.shape[1], w.weight.shape[2]


def expert_tensor(w: ExpertWeight) -> torch.Tensor:
    """The stacked tensor that holds the values (its first dim: the experts)."""
    if isinstance(w, Mxfp4Weight):
        return w.blocks
    return w.qweight if isinstance(w, IntGroupWeight) else w.weight


def expert_weight(w: ExpertWeight, expert: int) -> QuantizedWeight:
    """Expert ``expert``'s 2-D weight in the dense layout (views, no copy)."""
    return dataclasses.replace(w, **{
        f.name: getattr(w, f.name)[expert] for f in dataclasses.fields(w)
        if isinstance(getattr(w, f.name), torch.Tensor) and f.name not in _SHARED})


def stack_expert_weights(weights: list[QuantizedWeight]) -> ExpertWeight:
    """Per-expert weights of one projection (same format and shape) -> the stacked form."""
    first = weights[0]
    if isinstance(first, IntGroupWeight) and any(w.perm is not None for w in weights):
        raise ValueError("act-order (GPTQ desc_act) experts are not loadable: each expert "
                         "would read its input channels in its own order")
    changes = {}
    for f in dataclasses.fields(first):
        values = [getattr(w, f.name) for w in weights]
        if not isinstance(values[0], torch.Tensor):
            if any((v is None) != (values[0] is None) for v in values):
                raise ValueError(f"experts differ in {f.name}")
            continue
        if f.name in _SHARED:
            changes[f.name] = torch.stack([v.float() for v in values]).max()
        else:
            changes[f.name] = torch.stack(values)
    return dataclasses.replace(first, **changes)
