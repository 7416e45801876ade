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

# Two steps, as the engine runs them: a chunked prefill continuing from cached blocks
# beside a decode (the general kernel), then a pure-decode batch long enough for the
# decode kernel to split its KV (the kernel CUDA graphs replay).
CANARY_STEPS = {"prefill": [(5, 21), (1, 40)], "decode": [(1, 40), (1, 2100), (1, 21)]}


def attention_canary(impl, spec: AttentionSpec, block_size: int, device: torch.device
                     ) -> str | None:
    """None if ``impl`` passes both steps, else the reason (mismatch, NaN/Inf, exception)."""
    if spec.compress_rate is not None:
        return compressed_canary(impl, spec, block_size, device)
    if spec.use_mla:
        return mla_canary(impl, spec, block_size, device)
    for step, seqs in CANARY_STEPS.items():
        case = make_case(seqs, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                         head_size=spec.head_size, block_size=block_size, dtype=spec.dtype,
                         kv_cache_dtype=spec.kv_cache_dtype,
                         sliding_window=spec.sliding_window, soft_cap=spec.logit_soft_cap,
                         device=device.type, seed=1234, fp8_exact_kv=device.type == "cpu",
                         sinks=spec.has_sinks)
        reason = compare_with_reference(case, impl)
        if reason is not None:
            return f"numerics canary ({step} step): {reason}"
    return None


def mla_canary(impl, spec: AttentionSpec, block_size: int, device: torch.device) -> str | None:
    """The same two steps for an ``mla_attention`` implementation, at the model's MLA sizes
    (the prefill step mixes prompts, expanded, with a decode, absorbed)."""
    from archserve.kernels.mla.cases import compare_mla_with_reference, make_mla_case

    if spec.mla_sparse:
        return sparse_mla_canary(impl, spec, block_size, device)
    kv = "fp8_e4m3" if spec.kv_cache_dtype in ("fp8", "fp8_e4m3") else "auto"
    for step, seqs in CANARY_STEPS.items():
        case = make_mla_case(seqs, num_heads=spec.num_heads, kv_lora_rank=spec.kv_lora_rank,
                             rope=spec.qk_rope_head_dim, nope=spec.qk_nope_head_dim,
                             v_head=spec.v_head_dim, block_size=block_size, dtype=spec.dtype,
                             kv_cache_dtype=kv, device=device.type, seed=1234,
                             fp8_exact_kv=device.type == "cpu")
        reason = compare_mla_with_reference(case, impl)
        if reason is not None:
            return f"numerics canary ({step} step): {reason}"
    return None


def sparse_mla_canary(impl, spec: AttentionSpec, block_size: int, device: torch.device
                      ) -> str | None:
    """A sparse-MLA implementation at the model's sizes and cache layout, against the torch
    reference over the same rows: the two steps above, whose contexts are within top-k
    (dense MLA) but for the longest decode, and a prompt chunk past top-k beside a decode
    (the indexer and the indexed kernel over prompt rows)."""
    from archserve.kernels.attention.cases import compare_runs, tolerance
    from archserve.kernels.mla.sparse_cases import make_sparse_case
    from archserve.kernels.mla.torch_mla import TorchMlaImpl

    topk = spec.index_topk or 2048
    steps = {**CANARY_STEPS, "sparse prefill": [(37, topk + 63), (1, 30)]}
    reference = TorchMlaImpl(layout=impl.layout)
    for step, seqs in steps.items():
        case = make_sparse_case(seqs, topk=topk, num_heads=spec.num_heads,
                                kv_lora_rank=spec.kv_lora_rank, rope=spec.qk_rope_head_dim,
                                nope=spec.qk_nope_head_dim, v_head=spec.v_head_dim,
                                index_heads=spec.index_num_heads or 8,
                                index_dim=spec.index_head_dim, block_size=block_size,
                                dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype,
                                index_cache_dtype=spec.index_cache_dtype, device=device.type,
                                seed=1234)
        kv = "auto" if impl.layout.typed else "fp8"
        reason = compare_runs(case, impl, reference, tolerance(spec.dtype, kv))
        if reason is not None:
            return f"numerics canary ({step} step): {reason}"
    return None


def compressed_canary(impl, spec: AttentionSpec, block_size: int, device: torch.device
                      ) -> str | None:
    """DeepSeek V4's layers at the model's sizes, the selection kind's (compressed sparse
    where the model has it): a prompt continuing a cached prefix mid-group beside decodes,
    then a decode batch (contexts past the window, past a compressed group)."""
    from archserve.kernels.mla.dsv4_cases import (
        compare_compressed_with_reference,
        make_compressed_case,
    )

    window = spec.sliding_window or 128
    steps = {"prefill": [(9, 5), (window + 3, 1)], "decode": [(window + 9, 1), (3, 1)]}
    for step, seqs in steps.items():
        case = make_compressed_case(
            seqs, num_heads=spec.num_heads, head_dim=spec.head_size,
            rope_dim=spec.qk_rope_head_dim, window=window, compress_rate=spec.compress_rate,
            overlap=spec.mla_sparse, index_dim=spec.index_head_dim,
            index_heads=max(spec.index_num_heads, 1), topk=max(spec.index_topk or 1, 1),
            block_size=block_size, dtype=spec.dtype, device=device.type, seed=1234)
        reason = compare_compressed_with_reference(case, impl)
        if reason is not None:
            return f"numerics canary ({step} step): {reason}"
    return None
