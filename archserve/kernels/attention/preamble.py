"""The attention preamble: what a decoder layer does between its QKV GEMM and attention.

Per-head q/k RMSNorm (Qwen3; none for Llama), rotary on q and k, and the KV-cache write.
Where the fusion ``qk_norm_rope_cache`` runs (Triton route, a 16-bit cache, an attention
backend that reads this step's keys from the cache) it is one kernel that also writes the
cache; everywhere else it is the unfused path (two norm launches, the rotary launch,
then the backend's own cache write), which is also the reference the kernel is tested
against.
"""

from __future__ import annotations

import torch

from archserve.kernels.elementwise import apply_rotary, fusion_enabled, rms_norm

FUSION = "qk_norm_rope_cache"


def attention_preamble(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                       sin_cache: torch.Tensor,
                       norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                       num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, backend_takes_written_kv: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv [T, (H + 2 Hkv) D] -> (q [T, H D], k [T, Hkv D], v [T, Hkv D]) ready for the
    attention backend, or (q, None, None) when k and v are already in ``kv_cache``.

    ``norm_weights``: the (q_norm, k_norm) weights [D] with their ``eps``, or None.
    ``backend_takes_written_kv``: the backend reads this step's keys from the cache when
    given none (the cache is written here then)."""
    head_size = 2 * cos_cache.shape[-1]
    if backend_takes_written_kv and fusion_enabled(FUSION, qkv.device):
        from archserve.kernels.attention.triton_qk_norm_rope_cache import (
            qk_norm_rope_cache,
            qk_norm_rope_cache_unsupported,
        )
        if qk_norm_rope_cache_unsupported(qkv, num_heads, num_kv_heads, head_size, cos_cache,
                                          norm_weights, kv_cache) is None:
            q = qk_norm_rope_cache(qkv, positions, cos_cache, sin_cache, norm_weights, eps,
                                   kv_cache, slot_mapping, num_heads, num_kv_heads)
            return q, None, None
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                         num_kv_heads * head_size], dim=-1)
    if norm_weights is not None:
        q = rms_norm(q.view(num_tokens, -1, head_size), norm_weights[0], eps)[0]
        k = rms_norm(k.view(num_tokens, -1, head_size), norm_weights[1], eps)[0]
        q, k = q.view(num_tokens, -1), k.view(num_tokens, -1)
    q, k = apply_rotary(positions, q, k, cos_cache, sin_cache)
    return q, k, v.contiguous()
