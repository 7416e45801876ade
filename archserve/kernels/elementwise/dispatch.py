"""The one place that chooses between the fused Triton kernels and the torch references.

Triton runs when the tensors live on a CUDA or ROCm device (torch calls both "cuda") and
triton imports; everything else takes the torch reference, which is also the test oracle. The choice reads only
the device, dtypes and shapes, never tensor values, and the kernels neither synchronise
nor autotune, so a decode step through these functions can be captured in a CUDA graph
(after an eager warm-up has compiled the kernels).

Tests force a route with ``forced_fused_route("triton")``: on CPU tensors that works
under ``TRITON_INTERPRET=1``, which must be set before the kernel modules are imported.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from archserve.kernels.elementwise.reference import (
    gelu_tanh_and_mul_reference,
    rms_norm_reference,
    rotary_reference,
    silu_and_mul_reference,
)
from archserve.kernels.rules import triton_target_rule
from archserve.platform.detect import device_info_for

log = logging.getLogger(__name__)

Route = Literal["triton", "torch"]

# A row wider than this would need a looped kernel; no released model comes close.
MAX_NORM_WIDTH = 65536

_forced_route: Route | None = None

# Kernels that fuse work across ops, each of which ARCHSERVE_DISABLE_FUSIONS can turn off
# by name (a comma-separated list; "all" is not a name): so a benchmark times a model with
# and without each, and a fusion suspected of a fault can be ruled out in production.
DISABLE_FUSIONS_ENV = "ARCHSERVE_DISABLE_FUSIONS"
FUSIONS = {
    "qk_norm_rope_cache": "q/k RMSNorm, rotary and the KV-cache write after the QKV GEMM",
    # Only where the decode GEMM after the norm runs TRITON_SKINNY_GEMM's kernel and the
    # start-up tuner timed the prologue faster than the norm kernel (skinny_choice.py).
    "rms_norm_gemm": ("residual add + RMSNorm in the prologue of the GEMM after it (QKV, "
                      "gate/up, a MoE router, MLA's kv_a)"),
    # Decided when the model is built, on any device (TORCH_MOE runs them too).
    "shared_experts": "DeepSeek's shared experts stacked with the routed ones in the fused MoE",
    # Between two decode graphs, where the fused kernels' route is Triton.
    "graph_inputs": "a decode step's inputs into its CUDA graph's static buffers in one launch",
    "greedy_argmax": "a greedy batch's argmax in one launch over many programs",
    # Where the LM head's shape runs TRITON_SKINNY_GEMM's kernel (inside decode graphs).
    "lm_head_float": ("the LM head's float32 logits widened in its GEMM's epilogue, straight "
                      "into the decode graph's output buffer (no conversion, no copy)"),
    # The folding is decided when the weights load, on any device; the residual add per
    # call, where the fused kernels' route is Triton (models/layers/norm_folding.py).
    "fold_norm_weights": ("an RMSNorm's weight multiplied into the 16/32-bit GEMMs that read "
                          "its output (its own weight then ones), and a decoder block's "
                          "residual add in its last GEMM or MoE kernel where they can"),
}


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install failing on import
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


def fused_kernel_route(device: torch.device | str) -> tuple[Route, str]:
    """Which implementation elementwise ops on ``device`` take, and why (for logs/explain)."""
    if _forced_route is not None:
        return _forced_route, f"forced to {_forced_route} (forced_fused_route)"
    device_type = torch.device(device).type
    info = device_info_for(device)
    # A CPU tensor may stand for a GPU (platform.emulation.compile_target: kernels compiled
    # for a GPU this machine need not have).
    if device_type != "cuda" and not info.is_gpu:
        return "torch", f"tensors on {device_type}; the fused kernels run on CUDA/ROCm"
    if (reason := triton_target_rule(info)) is not None:
        return "torch", reason
    missing = _triton_import_error()
    if missing is not None:
        return "torch", missing
    return "triton", "CUDA/ROCm device and triton importable"


def fusion_enabled(name: str, device: torch.device | str) -> bool:
    """Whether the fusion ``name`` (one of ``FUSIONS``) runs for tensors on ``device``: the
    fused kernels' route is Triton and ``ARCHSERVE_DISABLE_FUSIONS`` does not list it."""
    return fusion_not_disabled(name) and fused_kernel_route(device)[0] == "triton"


def fusion_not_disabled(name: str) -> bool:
    """Whether ``ARCHSERVE_DISABLE_FUSIONS`` leaves the fusion ``name`` (one of
    ``FUSIONS``) on, whatever the device."""
    if name not in FUSIONS:
        raise ValueError(f"unknown fusion {name!r}; known: {', '.join(FUSIONS)}")
    disabled = {part.strip() for part in os.environ.get(DISABLE_FUSIONS_ENV, "").split(",")}
    return name not in disabled


@contextmanager
def forced_fused_route(route: Route) -> Iterator[None]:
    """Within the block, every elementwise op takes ``route`` regardless of device."""
    global _forced_route
    previous, _forced_route = _forced_route, route
    try:
        yield
    finally:
        _forced_route = previous


def _takes_triton(device: torch.device, unsupported: str | None) -> bool:
    if fused_kernel_route(device)[0] != "triton":
        return False
    if unsupported is not None:
        _log_fallback_once(unsupported)
        return False
    return True


@functools.cache
def _log_fallback_once(reason: str) -> None:
    log.info("fused elementwise kernel not used: %s; torch reference instead", reason)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, unit_offset: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weight * RMSNorm(x + residual), x + residual), or (.., x) without a residual.

    Statistics in fp32; the normalised row is cast to x's dtype before the weight multiply
    (HF numerics); the output dtype is the promotion of weight's and x's. Any leading
    shape: [T, hidden] for a layer norm, [T, heads, head_dim] for Qwen3's q/k norm.
    ``unit_offset`` (Gemma): scale by (1 + weight) in fp32, output in x's dtype.
    """
    unsupported = None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        unsupported = "rms_norm residual with a different shape or dtype than its input"
    elif x.shape[-1] > MAX_NORM_WIDTH or weight.shape != x.shape[-1:]:
        unsupported = f"rms_norm row width {x.shape[-1]} (weight {tuple(weight.shape)})"
    if _takes_triton(x.device, unsupported):
        from archserve.kernels.elementwise.triton_rms_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual, unit_offset)
    return rms_norm_reference(x, weight, eps, residual, unit_offset)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_cache: torch.Tensor, sin_cache: torch.Tensor, inplace: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary: positions [T]; q [T, Hq*D]; k [T, Hkv*D]; caches [max_pos, D/2].

    Returns rotated (q, k); with ``inplace`` they are written into q and k and returned.
    """
    head_size = 2 * cos_cache.shape[-1]
    unsupported = None
    if q.dim() != 2 or k.dim() != 2 or q.shape[1] % head_size or k.shape[1] % head_size:
        unsupported = f"rotary on q {tuple(q.shape)}, k {tuple(k.shape)}, head {head_size}"
    elif q.dtype != k.dtype:
        unsupported = "rotary with q and k of different dtypes"
    if _takes_triton(q.device, unsupported):
        from archserve.kernels.elementwise.triton_rotary import rotary_triton
        return rotary_triton(positions, q, k, cos_cache, sin_cache, inplace=inplace)
    q_rotated, k_rotated = rotary_reference(positions, q, k, cos_cache, sin_cache)
    if inplace:
        return q.copy_(q_rotated), k.copy_(k_rotated)
    return q_rotated, k_rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [.., 2I] (gate then up) -> silu(gate) * up [.., I]."""
    unsupported = "silu_and_mul on an odd last dimension" if x.shape[-1] % 2 else None
    if _takes_triton(x.device, unsupported):
        from archserve.kernels.elementwise.triton_gated_act import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [.., 2I] (gate then up) -> gelu(gate, approximate="tanh") * up [.., I]."""
    unsupported = "gelu_tanh_and_mul on an odd last dimension" if x.shape[-1] % 2 else None
    if _takes_triton(x.device, unsupported):
        from archserve.kernels.elementwise.triton_gated_act import gelu_tanh_and_mul_triton
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_reference(x)


def hyper_connection_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                         scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                         norm_weight: torch.Tensor, block_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek V4's hyper-connection before a block: streams x [T, n, H] -> (the block's
    input: the streams' collapse through the block's RMSNorm (``norm_weight``,
    ``block_eps``), [T, H] in x's dtype; post [T, n]; comb [T, n, n] fp32)
    (kernels/elementwise/hyper_connection_reference.py)."""
    if _takes_triton(x.device, None):
        from archserve.kernels.elementwise.triton_hyper_connection import hc_pre_triton
        return hc_pre_triton(x, fn, base, scale, norm_eps, hc_eps, iters, norm_weight,
                             block_eps)
    from archserve.kernels.elementwise.hyper_connection_reference import hc_pre_reference
    collapsed, post, comb = hc_pre_reference(x, fn, base, scale, norm_eps, hc_eps, iters)
    return rms_norm_reference(collapsed, norm_weight, block_eps)[0], post, comb


def hyper_connection_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post_i * out + sum_j comb[j, i] x_j [T, n, H]."""
    if _takes_triton(x.device, None):
        from archserve.kernels.elementwise.triton_hyper_connection import hc_post_triton
        return hc_post_triton(x, out, post, comb)
    from archserve.kernels.elementwise.hyper_connection_reference import hc_post_reference
    return hc_post_reference(x, out, post, comb)


def hyper_connection_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                          scale: torch.Tensor, norm_eps: float, hc_eps: float,
                          norm_weight: torch.Tensor, block_eps: float) -> torch.Tensor:
    """The streams' final collapse [T, n, H] -> [T, H], through the model's last RMSNorm."""
    if _takes_triton(x.device, None):
        from archserve.kernels.elementwise.triton_hyper_connection import hc_head_triton
        return hc_head_triton(x, fn, base, scale, norm_eps, hc_eps, norm_weight, block_eps)
    from archserve.kernels.elementwise.hyper_connection_reference import hc_head_reference
    collapsed = hc_head_reference(x, fn, base, scale, norm_eps, hc_eps)
    return rms_norm_reference(collapsed, norm_weight, block_eps)[0]


def norm_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          weight: torch.Tensor | None = None, eps: float | None = None,
                          inverse: bool = False) -> torch.Tensor:
    """DeepSeek V4's per-head transform: x [T, D] or [T, H, D] RMS-normalised when ``eps``
    is given (with ``weight`` or unweighted), then its trailing 2 * len(inv_freq) channels
    rotated as interleaved pairs at ``positions`` [T] (``inverse``: rotated back)."""
    unsupported = "norm_rope_interleaved on non-dense channels" if x.stride(-1) != 1 else None
    if _takes_triton(x.device, unsupported):
        from archserve.kernels.elementwise.triton_norm_rope import norm_rope_interleaved_triton
        return norm_rope_interleaved_triton(x, positions, inv_freq, weight, eps, inverse)
    from archserve.kernels.elementwise.reference import norm_rope_interleaved_reference
    return norm_rope_interleaved_reference(x, positions, inv_freq, weight, eps, inverse)
