"""TRITON_FUSED_MOE's implementation: routing in one launch, then the 16-bit and MXFP4
experts' kernels (triton_fused_moe.py: MXFP4 is weight-only, decoded in those kernels'
registers, so it takes their every layout and the tuner's tiles) or the other quantized
experts' (triton_quantized_moe.py)."""

from __future__ import annotations

from typing import Any

import torch

from archserve.kernels.linear.quantized_weights import Mxfp4Weight
from archserve.kernels.moe.expert_activation import (
    DEFAULT_ACTIVATION,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.triton_fused_moe import (
    MoETile,
    choose_tile,
    default_tile,
    fused_moe,
    fused_moe_unsupported,
    token_bucket,
)
from archserve.kernels.moe.triton_quantized_moe import quantized_moe
from archserve.kernels.moe.triton_routing import triton_route


class TritonFusedMoEImpl:
    """The backend's implementation: ``forward`` as TORCH_MOE's, through the fused kernels.
    ``tiles`` maps a token bucket (``token_bucket``) to the tile the tuner chose."""

    graph_capturable = True
    adds_residual = True    # forward takes ``add`` for 16-bit experts (FusedMoE.forward_add)

    def __init__(self, device: Any = None, spec: Any = None) -> None:
        self.device = device
        self.spec = spec
        self.tiles: dict[int, MoETile] = {}

    def tile_for(self, num_tokens: int, top_k: int, w13: Any, w2: Any) -> MoETile:
        return (self.tiles.get(token_bucket(num_tokens))
                or choose_tile(num_tokens, top_k, w13, w2))

    def prepare(self, quantized: Any, dtype: torch.dtype) -> tuple[Any, Any]:
        """Quantized experts (QuantizedExperts) as ``forward`` takes them: as they are."""
        return quantized.w13, quantized.w2

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool, **grouping
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of ``routing.grouped_route`` (its keywords in ``grouping``)
        in one launch."""
        return triton_route(router_logits, top_k, renormalize, **grouping)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, w13: Any, w2: Any,
                top_k: int, renormalize: bool = True,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None,
                add: torch.Tensor | None = None,
                activation: GatedActivation = DEFAULT_ACTIVATION,
                biases: ExpertBiases | None = None) -> torch.Tensor:
        """TORCH_MOE's forward; with ``add`` (16-bit experts only), plus it, in the kernel
        that sums each token's slots (``fused_experts``)."""
        routed = routed or triton_route(router_logits, top_k, renormalize)
        mxfp4 = isinstance(w13, Mxfp4Weight)
        if not isinstance(w13, torch.Tensor) and not mxfp4:   # fp8, integer experts
            if add is not None:
                raise ValueError("TRITON_FUSED_MOE adds a residual for 16-bit experts only")
            # Their kernels take the sorted layout's tiles (never pair rows), and the
            # tuner times 16-bit experts only: the default sorted tile of this batch.
            return quantized_moe(hidden, router_logits, w13, w2, top_k, renormalize,
                                 default_tile(hidden.shape[0]), routed, activation, biases)
        reason = fused_moe_unsupported(hidden, w13, w2)
        if reason is not None:
            raise ValueError(f"TRITON_FUSED_MOE cannot run this layer: {reason}")
        if mxfp4 and add is not None:
            raise ValueError("TRITON_FUSED_MOE adds a residual for 16-bit experts only")
        return fused_moe(hidden, router_logits, w13, w2, top_k, renormalize,
                         self.tile_for(hidden.shape[0], top_k, w13, w2), routed, add,
                         activation, biases)
