"""Numerics canaries: a selected kernel must agree with TORCH_REFERENCE before it serves.

A kernel library can import fine and still be wrong on this device (a miscompiled
kernel, a driver bug, an unsupported layout that slips past the rules). At start-up
the engine runs each attention candidate once on a tiny paged problem shaped like the
model's layers; a candidate that fails is demoted, and the reason joins the route.
"""

from __future__ import annotations

import torch

from archserve.kernels.attention.cases import compare_with_reference, make_case
from archserve.kernels.specs import AttentionSpec

# A chunked prefill continuing from cached blocks next to two decodes (one splits the KV).
CANARY_SEQS = [(5, 21), (1, 40), (1, 1100)]


def attention_canary(impl, spec: AttentionSpec, block_size: int, device: torch.device
                     ) -> str | None:
    """None if ``impl`` passes, else the reason (mismatch, NaN/Inf, or an exception)."""
    case = make_case(CANARY_SEQS, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_size=spec.head_size, block_size=block_size, dtype=spec.dtype,
                     kv_cache_dtype=spec.kv_cache_dtype, sliding_window=spec.sliding_window,
                     soft_cap=spec.logit_soft_cap, device=device.type, seed=1234,
                     fp8_exact_kv=device.type == "cpu")
    reason = compare_with_reference(case, impl)
    return None if reason is None else f"numerics canary: {reason}"
