"""Random paged-attention problems, and the comparison of an implementation with the reference.

A case is a batch of sequences, each given as (query_len, seq_len): the first
``seq_len - query_len`` tokens are already in the cache (random contents), the rest are
this step's tokens. Physical blocks are shuffled so that block tables are not contiguous.
The kernel tests use it over many shapes; the engine's numerics canary uses it once, at
start-up, on the selected backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archserve.kernels.attention.interface import (
    AttentionLayerParams,
    AttentionMetadata,
    kv_cache_shape,
)
from archserve.kernels.attention.reference import ReferenceAttentionImpl

FP8_CACHE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class AttentionCase:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    layer: AttentionLayerParams
    k_scale: float
    v_scale: float
    num_valid_tokens: int

    def run(self, impl) -> tuple[torch.Tensor, torch.Tensor]:
        """(output rows of real tokens, the cache after the step) for one implementation."""
        cache = self.kv_cache.clone()
        out = impl.forward(self.query, self.key, self.value, cache, self.meta, self.layer,
                           self.k_scale, self.v_scale)
        return out[: self.num_valid_tokens], cache


def make_case(seqs: list[tuple[int, int]], *, num_heads: int = 4, num_kv_heads: int = 1,
              head_size: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
              kv_cache_dtype: str = "auto", sliding_window: int | None = None,
              soft_cap: float | None = None, pad_tokens: int = 0, device: str = "cpu",
              seed: int = 0, fp8_exact_kv: bool = True, sinks: bool = False) -> AttentionCase:
    """``fp8_exact_kv``: with an fp8 cache, make this step's K/V exactly representable after
    scaling, so writing needs no rounding. Triton's CPU interpreter rounds fp32 -> fp8 wrongly
    at binade edges (1.97 -> 1.0), so CPU tests keep this on; GPU tests turn it off.
    ``sinks``: a float32 sink logit per query head, around the scores' own scale (2 sigma of
    N(0, 1) scores), so it takes a share of each row that a kernel ignoring it would miss.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(seq_len + block_size - 1) // block_size for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no sequence owns
    physical = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[used:used + n].to(torch.int32)
        used += n

    slots, query_lens = [], []
    for i, (query_len, seq_len) in enumerate(seqs):
        positions = torch.arange(seq_len - query_len, seq_len)
        blocks = block_tables[i, positions // block_size].long()
        slots.append(blocks * block_size + positions % block_size)
        query_lens.append(query_len)
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.long))
    slot_mapping = torch.cat(slots)
    num_tokens = slot_mapping.shape[0]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_dtype = FP8_CACHE.get(kv_cache_dtype, dtype)
    k_scale = v_scale = 1.0
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size),
                        generator=gen)
    if kv_cache_dtype in FP8_CACHE:
        k_scale, v_scale = 0.5, 0.25
        cache[0] /= k_scale
        cache[1] /= v_scale
    meta = AttentionMetadata.from_lengths(query_lens, [s for _, s in seqs], block_tables,
                                          slot_mapping, device)
    layer = AttentionLayerParams(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 head_size=head_size, scale=head_size ** -0.5,
                                 sliding_window=sliding_window, logit_soft_cap=soft_cap,
                                 kv_cache_dtype=kv_cache_dtype,
                                 sinks=(2.0 * torch.randn(num_heads, generator=gen)).to(device)
                                 if sinks else None)
    key = randn(num_tokens, num_kv_heads, head_size)
    value = randn(num_tokens, num_kv_heads, head_size)
    if kv_cache_dtype in FP8_CACHE and fp8_exact_kv:
        key = ((key.float() / k_scale).to(cache_dtype).float() * k_scale).to(dtype)
        value = ((value.float() / v_scale).to(cache_dtype).float() * v_scale).to(dtype)
    return AttentionCase(
        query=randn(num_tokens, num_heads, head_size).to(device),
        key=key.to(device),
        value=value.to(device),
        kv_cache=cache.to(cache_dtype).to(device),
        meta=meta, layer=layer, k_scale=k_scale, v_scale=v_scale,
        num_valid_tokens=sum(query_lens),
    )


def tolerance(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> float:
    if kv_cache_dtype != "auto":
        return 2e-2  # both read the same fp8 values; the slack is for the query's dtype
    return {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]


def reference_run(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    return case.run(ReferenceAttentionImpl())


def compare_with_reference(case: AttentionCase, impl) -> str | None:
    """None if ``impl`` matches the reference on ``case`` (finite, within tolerance), else why."""
    return compare_runs(case, impl, ReferenceAttentionImpl(),
                        tolerance(case.query.dtype, case.layer.kv_cache_dtype))


def compare_runs(case, impl, reference, tol: float) -> str | None:  # noqa: ANN001
    """None if ``impl``'s output on ``case`` (any case with ``run(impl)``) is finite and
    within ``tol`` of ``reference``'s, relative to the reference's largest magnitude when
    that exceeds 1; else why not, in the words of a failed canary."""
    expected, _ = case.run(reference)
    try:
        actual, _ = case.run(impl)
    except Exception as exc:  # a kernel that cannot even run fails its canary
        return f"failed to run: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not torch.isfinite(actual.float()).all():
        return "produced NaN or Inf"
    err = (actual.float() - expected.float()).abs().max().item()
    bound = tol * max(1.0, expected.float().abs().max().item())
    if err > bound:
        return f"max error {err:.3g} against TORCH_REFERENCE exceeds {bound:.3g}"
    return None


def with_empty_slots(meta: AttentionMetadata, empty: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc, seq_lens, block_tables) of ``meta`` followed by ``empty`` sequence
    slots without tokens, as a captured mixed-step bucket lays a step out."""
    starts = torch.cat((meta.query_start_loc, meta.query_start_loc[-1:].repeat(empty)))
    seq_lens = torch.cat((meta.seq_lens, meta.seq_lens.new_zeros(empty)))
    tables = torch.cat((meta.block_tables,
                        meta.block_tables.new_zeros((empty, meta.block_tables.shape[1]))))
    return starts, seq_lens, tables
