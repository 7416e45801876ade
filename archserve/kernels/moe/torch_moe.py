"""TORCH_MOE: the universal MoE fallback — route, then loop over the experts that got tokens.

Weights use the fused layout the model layer keeps: ``w13[e]`` is expert e's gate and up
projections stacked ([2I, H], gate first), ``w2[e]`` its down projection ([H, I]).
Work is proportional to routed tokens (each expert sees only its tokens), so it runs on
any device; a fused kernel (TRITON_FUSED_MOE) replaces the Python loop on GPUs.

Quantized experts (kernels/moe/quantized_experts.py) are dequantized once, at start-up,
expert by expert as TORCH_DEQUANT does a dense layer (no memory saving); a W8A8
checkpoint's activations are still quantized as its scheme says, so the products are
those of the quantized kernels, computed in floating point.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from archserve.kernels.linear.torch_dequant import DequantizedWeight, TorchDequantLinear
from archserve.kernels.moe.expert_activation import (
    DEFAULT_ACTIVATION,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.quantized_experts import QuantizedExperts, expert_weight
from archserve.kernels.moe.routing import grouped_route, route

__all__ = ["TorchMoEImpl", "route"]
_DEQUANT = TorchDequantLinear()


def _linear(x: torch.Tensor, w: torch.Tensor | DequantizedWeight, expert: int) -> torch.Tensor:
    if isinstance(w, DequantizedWeight):
        return _DEQUANT(x, dataclasses.replace(w, weight=w.weight[expert]))
    return F.linear(x, w[expert])


class TorchMoEImpl:
    def __init__(self, device: Any = None, spec: Any = None) -> None:
        self.device = device
        self.spec = spec

    def prepare(self, quantized: QuantizedExperts, dtype: torch.dtype
                ) -> tuple[DequantizedWeight, DequantizedWeight]:
        """(w13, w2) for ``forward``: each stacked weight dequantized to ``dtype``."""
        def dense(w) -> DequantizedWeight:  # noqa: ANN001 - an ExpertWeight
            per_expert = [_DEQUANT.prepare(expert_weight(w, e), dtype)
                          for e in range(quantized.num_experts)]
            return dataclasses.replace(per_expert[0], weight=torch.stack(
                [p.weight for p in per_expert]))
        return dense(quantized.w13), dense(quantized.w2)

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool, **grouping
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of ``routing.grouped_route`` (its keywords in ``grouping``)."""
        return grouped_route(router_logits, top_k, renormalize=renormalize, **grouping)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, top_k: int, renormalize: bool = True,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None,
                activation: GatedActivation = DEFAULT_ACTIVATION,
                biases: ExpertBiases | None = None) -> torch.Tensor:
        """hidden [T, H] -> [T, H]: sum over each token's top-k experts of weight * expert(x).
        ``routed``: (weights, experts) [T, k] chosen by the model (DeepSeek's grouped top-k)
        instead of the softmax top-k of the logits. ``activation`` between gate/up and
        down; ``biases`` added after each projection (the down bias before the weight)."""
        weights, experts = routed or route(router_logits, top_k, renormalize)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        flat_experts = experts.reshape(-1)
        token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
        order = flat_experts.argsort()
        counts = torch.bincount(flat_experts, minlength=_num_experts(w13)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start:start + count]
            start += count
            tokens = token_of[picks]
            x = hidden[tokens]
            gate_up = _linear(x, w13, expert)
            if biases is not None:
                gate_up = gate_up + biases.w13[expert].to(gate_up.dtype)
            y = _linear(activation(*gate_up.chunk(2, dim=-1)), w2, expert)
            if biases is not None and biases.w2 is not None:
                y = y + biases.w2[expert].to(y.dtype)
            out.index_add_(0, tokens, y.float() * weights.reshape(-1)[picks, None])
        return out.to(hidden.dtype)


def _num_experts(w13: torch.Tensor | DequantizedWeight) -> int:
    return (w13.weight if isinstance(w13, DequantizedWeight) else w13).shape[0]
