"""Rotary position embedding (neox / HF ``rotate_half`` layout) with a precomputed cache.

Supported scalings: none ("default"), "linear" (positions divided by a factor),
"llama3" (Llama 3.1's frequency-band-dependent stretch) and "yarn" (DeepSeek's: a ramp
between interpolated and extrapolated frequencies, cos/sin scaled by an attention factor
from mscale / mscale_all_dim). The cos/sin cache covers every position up to
``max_position`` so a forward is one gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from archserve.kernels.elementwise import apply_rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, rotary_dim: int, base: float,
                              scaling: dict[str, Any]) -> torch.Tensor:
    # Dimensions that rotate fewer than beta_slow times over the original context are
    # interpolated (divided by factor), more than beta_fast times kept; a linear ramp between.
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 for every other scaling)."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


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
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_size, base, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dimensions stored as interleaved pairs (x0, x1), (x2, x3) ... -> the evens, then
    the odds: the neox rotation of that order rotates each pair as the interleaved one
    would, and leaves every q.k product unchanged (DeepSeek's MLA, GLM-5's indexer)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = inverse_frequencies(head_size, base, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)
        # [max_position, head_size // 2] each; fp32, cast to the activations' dtype per use.
        self.register_buffer("cos_cache", angles.cos() * factor, persistent=False)
        self.register_buffer("sin_cache", angles.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H*D], k [T, Hkv*D] -> rotated q, k (same shapes and dtype)."""
        return apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)
