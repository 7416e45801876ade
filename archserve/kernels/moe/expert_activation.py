"""What an expert computes between its gate/up and its down projection, and its biases.

Most MoE families run ``silu(gate) * up``. gpt-oss runs its own clamped SwiGLU
(transformers' GptOssExperts, vLLM's "swigluoai"):

    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    act  = (up + 1) * gate * sigmoid(alpha * gate)

DeepSeek V4 clamps the same way at its ``swiglu_limit``, then runs plain SwiGLU
(transformers' DeepseekV4Experts), "silu_clamped" here:

    act  = silu(min(gate, limit)) * clamp(up, -limit, limit)

and adds a bias after each of its expert projections. Every MoE backend that runs such a
layer takes the activation and the biases; the torch reference here is the oracle its
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SILU = "silu"
SWIGLU_OAI = "swigluoai"
SILU_CLAMPED = "silu_clamped"
ACTIVATION_KINDS = (SILU, SWIGLU_OAI, SILU_CLAMPED)
# How the Triton kernels name them (a constexpr: triton_common.gated_activation).
ACTIVATION_CODES = {SILU: 0, SWIGLU_OAI: 1, SILU_CLAMPED: 2}


@dataclass(frozen=True)
class GatedActivation:
    kind: str = SILU
    alpha: float = 1.702            # swigluoai: the sigmoid's gain
    limit: float = 7.0              # swigluoai, silu_clamped: the clamp of gate (above) and
                                    # up (both sides)

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"expert activation {self.kind!r} is not one of "
                             f"{', '.join(ACTIVATION_KINDS)}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of gate and up (the same shape), in their dtype."""
        if self.kind == SILU:
            return torch.nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        if self.kind == SILU_CLAMPED:
            return torch.nn.functional.silu(gate) * up
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


DEFAULT_ACTIVATION = GatedActivation()


@dataclass(frozen=True)
class ExpertBiases:
    """Per-expert biases: ``w13`` [E, 2I] (gate then up, as the stacked weights) and ``w2``
    [E, H] (None: this rank adds none, the other tensor-parallel ranks' sum has it)."""

    w13: torch.Tensor
    w2: torch.Tensor | None
