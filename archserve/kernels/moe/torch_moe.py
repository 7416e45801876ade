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


def _linear(x: torch.Tensor, w: DequantizedWeight, expert: int) -> torch.Tensor:
    return _DEQUANT(x, dataclasses.replace(w, weight=w.weight[expert]))


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
        # One opaque op over the expert loop: its per-expert token counts are data, which
        # a traced decode step (engine/cpu_compiled_step.py) cannot hold as shapes.
        return experts_op(hidden, weights, experts, *_flat_weight(w13), *_flat_weight(w2),
                          None if biases is None else biases.w13,
                          None if biases is None else biases.w2,
                          activation.kind, activation.alpha, activation.limit)


def _flat_weight(w: torch.Tensor | DequantizedWeight
                 ) -> tuple[torch.Tensor, str, torch.Tensor | None, bool]:
    """A stacked weight as the op's arguments (a 16-bit one as a DequantizedWeight whose
    activations are not quantized: the same F.linear)."""
    if not isinstance(w, DequantizedWeight):
        w = DequantizedWeight(w)
    return w.weight, w.activation, w.input_scale, w.fp8_activations


@torch.library.custom_op("archserve::torch_moe_experts", mutates_args=())
def experts_op(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               w13: torch.Tensor, w13_activation: str, w13_input_scale: torch.Tensor | None,
               w13_fp8: bool, w2: torch.Tensor, w2_activation: str,
               w2_input_scale: torch.Tensor | None, w2_fp8: bool,
               w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
               kind: str, alpha: float, limit: float) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over each token's experts (``experts`` [T, k], their
    ``weights``) of weight * expert(x), an expert at a time over its tokens."""
    gate_up_w = DequantizedWeight(w13, w13_activation, w13_input_scale, w13_fp8)
    down_w = DequantizedWeight(w2, w2_activation, w2_input_scale, w2_fp8)
    activation = GatedActivation(kind, alpha, limit)
    top_k = experts.shape[-1]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_experts = experts.reshape(-1)
    token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
    order = flat_experts.argsort()
    counts = torch.bincount(flat_experts, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]
        start += count
        tokens = token_of[picks]
        gate_up = _linear(hidden[tokens], gate_up_w, expert)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].to(gate_up.dtype)
        y = _linear(activation(*gate_up.chunk(2, dim=-1)), down_w, expert)
        if w2_bias is not None:
            y = y + w2_bias[expert].to(y.dtype)
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[picks, None])
    return out.to(hidden.dtype)


@experts_op.register_fake
def _experts_shape(hidden: torch.Tensor, *args) -> torch.Tensor:  # noqa: ANN002
    return torch.empty_like(hidden)
