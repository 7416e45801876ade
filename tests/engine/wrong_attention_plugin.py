"""A third-party attention backend that is subtly wrong: the canary must catch it."""

from __future__ import annotations

from dataclasses import replace

from archserve.kernels.attention.reference import ReferenceAttentionImpl
from archserve.kernels.registry import Backend


class WrongScaleImpl(ReferenceAttentionImpl):
    """Correct cache writes, attention computed with a softmax scale 10% off."""

    def forward(self, query, key, value, kv_cache, meta, layer, k_scale=1.0, v_scale=1.0):
        return super().forward(query, key, value, kv_cache, meta,
                               replace(layer, scale=layer.scale * 1.1), k_scale, v_scale)


class WrongAttention(Backend):
    name = "WRONG_ATTN"
    op = "attention"
    description = "a plug-in whose kernel is numerically wrong"

    def make_impl(self, device, spec):
        return WrongScaleImpl(device, spec)


def register(registry) -> None:
    registry.register(WrongAttention())
