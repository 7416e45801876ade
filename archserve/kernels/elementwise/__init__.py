"""Fused elementwise ops (RMSNorm + residual, rotary, SiLU * mul, GELU-tanh * mul): Triton
on GPUs, torch elsewhere, chosen in ``dispatch``. Layers call these functions, never a
kernel module.

The kernel modules are named triton_* so that importing one never shadows a function of
the same name exported here (a submodule import sets an attribute on this package).
"""

from archserve.kernels.elementwise.dispatch import (
    DISABLE_FUSIONS_ENV,
    FUSIONS,
    apply_rotary,
    forced_fused_route,
    fused_kernel_route,
    fusion_enabled,
    gelu_tanh_and_mul,
    hyper_connection_head,
    hyper_connection_post,
    hyper_connection_pre,
    norm_rope_interleaved,
    rms_norm,
    silu_and_mul,
)

__all__ = ["DISABLE_FUSIONS_ENV", "FUSIONS", "apply_rotary", "forced_fused_route",
           "fused_kernel_route", "fusion_enabled", "gelu_tanh_and_mul", "hyper_connection_head",
           "hyper_connection_post", "hyper_connection_pre", "norm_rope_interleaved", "rms_norm",
           "silu_and_mul"]
