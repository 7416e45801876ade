"""Rotary position embedding (neox / HF ``rotate_half`` layout) with a precomputed cache.

Supported scalings: none ("default"), "linear" (positions divided by a factor) and
"llama3" (Llama 3.1's frequency-band-dependent stretch). The cos/sin cache covers every
position up to ``max_position`` so a forward is one gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from archserve.kernels.elementwise import apply_rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _base_inverse_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / (base ** exponents)).float()


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Wavelengths longer than the original context / low_freq_factor are stretched by
    # `factor`; shorter than context / high_freq_factor are kept; the band between is
    # interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, stretched)


def inverse_frequencies(head_size: int, base: float, scaling: dict[str, Any] | None
                        ) -> torch.Tensor:
    inv_freq = _base_inverse_frequencies(head_size, base)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = inverse_frequencies(head_size, base, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_size // 2] each; fp32, cast to the activations' dtype per use.
        self.register_buffer("cos_cache", angles.cos(), persistent=False)
        self.register_buffer("sin_cache", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H*D], k [T, Hkv*D] -> rotated q, k (same shapes and dtype)."""
        return apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)
