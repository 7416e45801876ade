"""FP8 KV-cache scales of one attention layer: from the checkpoint, or calibrated.

An fp8 cache stores ``k / k_scale`` and ``v / v_scale``; attention multiplies them back.
With the default 1.0, keys or values beyond fp8's range (448 for e4m3) saturate and small
ones lose their mantissa. Checkpoints quantized for an fp8 cache carry one scale per layer
(llm-compressor, ModelOpt, AutoFP8 each name it differently: ``CHECKPOINT_NAMES``);
without one, ``calculate_kv_scales`` measures them on the first real prefill, as vLLM's
option of that name does, with vLLM's headroom constants (``K_SCALE_RANGE``,
``V_SCALE_RANGE``: the measured maximum maps to 200 and 100, well inside e4m3's 448,
since later tokens may be larger than the first prompt's).

The scales are Python floats: the kernels take them as launch arguments, and a captured
CUDA graph bakes them in, so graphs are captured only once the scales are final.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0
QUANTIZED_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")

# Checkpoint tensor name, after the layer's ``self_attn.`` prefix -> the planes it scales.
CHECKPOINT_NAMES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",), "v_scale": ("v",),                        # llm-compressor, vLLM
    "attn.k_scale": ("k",), "attn.v_scale": ("v",),
    "kv_scale": ("k", "v"),                                      # older AutoFP8: one for both
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),          # ModelOpt
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),  # compressed-tensors
}


def checkpoint_kv_scale(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the attention module's path, planes) when ``name`` is a KV-cache scale, else None."""
    for suffix, planes in CHECKPOINT_NAMES.items():
        if name.endswith(".self_attn." + suffix):
            return name[: -len(suffix) - 1], planes
    return None


def is_quantized_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in QUANTIZED_CACHE_DTYPES


class KVCacheScales:
    """Mixin of attention layers: this layer's k/v scales and how they are set."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    kv_scales_from: str = "default"     # default | checkpoint | calibrated

    def load_kv_scale(self, planes: tuple[str, ...], tensor: torch.Tensor) -> None:
        """A checkpoint scale: per tensor, or per KV head (one scale for the whole cache
        here: the largest, which keeps every head inside fp8's range)."""
        values = tensor.detach().float().reshape(-1)
        if values.numel() == 0 or not bool(torch.isfinite(values).all()) or values.min() <= 0:
            raise ValueError(f"KV-cache scale must be positive and finite, got {values.tolist()}")
        scale = float(values.max())
        for plane in planes:
            setattr(self, f"{plane}_scale", scale)
        self.kv_scales_from = "checkpoint"

    def calibrate_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set both scales from this forward's keys and values (one host read each)."""
        for plane, x, span in (("k", key, K_SCALE_RANGE), ("v", value, V_SCALE_RANGE)):
            amax = float(x.detach().abs().max()) if x.numel() else 0.0
            if amax > 0 and amax != float("inf"):
                setattr(self, f"{plane}_scale", amax / span)
        self.kv_scales_from = "calibrated"

    def kv_scales(self, kv_cache_dtype: str, calibrate: bool, key: torch.Tensor | None,
                  value: torch.Tensor | None) -> tuple[float, float]:
        """The scales this forward writes and reads the cache with: 1.0 for a 16-bit cache
        (a checkpoint's fp8 scales would only distort it). key/value None: a fused kernel
        wrote them already (16-bit caches only), nothing to measure."""
        if not is_quantized_cache(kv_cache_dtype):
            return 1.0, 1.0
        if calibrate and key is not None and self.kv_scales_from != "calibrated":
            self.calibrate_kv_scales(key, value)
        return self.k_scale, self.v_scale
