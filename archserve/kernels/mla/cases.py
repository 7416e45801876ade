"""Random paged MLA problems, and the comparison of an MLA implementation with TORCH_REFERENCE.

A case is the standard attention case (kernels/attention/cases.py: shuffled block tables, a
cached prefix of random contents, this step's rows) with one KV head of the latent size,
of which the key plane becomes the latent cache and this step's keys the latent rows; the
query's last ``rope`` columns are q_pe, and q_nope and the two halves of kv_b_proj are drawn
beside it. The kernel tests and the engine's numerics canary share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archserve.kernels.attention.cases import compare_runs, make_case, tolerance
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.mla.interface import absorb_query
from archserve.kernels.mla.torch_mla import TorchMlaImpl


@dataclass
class MlaCase:
    q_nope: torch.Tensor        # [T, H, nope]
    q_pe: torch.Tensor          # [T, H, rope]
    latent: torch.Tensor        # [T, L + rope], this step's rows
    kv_cache: torch.Tensor      # [1, blocks, block_size, 1, L + rope], the prefix written
    meta: AttentionMetadata
    w_uk: torch.Tensor          # [H, nope, L]
    w_uv: torch.Tensor          # [H, v, L]
    scale: float
    k_scale: float
    num_valid_tokens: int

    @property
    def absorbed_query(self) -> torch.Tensor:
        return absorb_query(self.q_nope, self.q_pe, self.w_uk)

    def run(self, impl) -> tuple[torch.Tensor, torch.Tensor]:
        """(output rows of real tokens [T, H, v], the cache after the step)."""
        cache = self.kv_cache.clone()
        out = impl.forward(self.q_nope, self.q_pe, self.latent, cache, self.meta, self.w_uk,
                           self.w_uv, self.scale, self.k_scale)
        return out[: self.num_valid_tokens], cache


def make_mla_case(seqs: list[tuple[int, int]], *, num_heads: int = 4, kv_lora_rank: int = 32,
                  rope: int = 16, nope: int = 16, v_head: int = 16, block_size: int = 16,
                  dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                  pad_tokens: int = 0, device: str = "cpu", seed: int = 0,
                  fp8_exact_kv: bool = True) -> MlaCase:
    """``seqs`` as for make_case: (query_len, seq_len) per sequence."""
    base = make_case(seqs, num_heads=num_heads, num_kv_heads=1,
                     head_size=kv_lora_rank + rope, block_size=block_size, dtype=dtype,
                     kv_cache_dtype=kv_cache_dtype, pad_tokens=pad_tokens, device=device,
                     seed=seed, fp8_exact_kv=fp8_exact_kv)
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)

    num_tokens = base.query.shape[0]
    return MlaCase(
        q_nope=randn(num_tokens, num_heads, nope),
        q_pe=base.query[..., kv_lora_rank:].contiguous(),
        latent=base.key[:, 0].contiguous(),
        kv_cache=base.kv_cache[:1].contiguous(),
        meta=base.meta,
        w_uk=randn(num_heads, nope, kv_lora_rank, std=kv_lora_rank ** -0.5),
        w_uv=randn(num_heads, v_head, kv_lora_rank, std=kv_lora_rank ** -0.5),
        scale=(nope + rope) ** -0.5, k_scale=base.k_scale,
        num_valid_tokens=base.num_valid_tokens)


def compare_mla_with_reference(case: MlaCase, impl) -> str | None:
    """None if ``impl`` matches TORCH_REFERENCE on ``case`` (finite, within tolerance)."""
    kv = "auto" if case.kv_cache.dtype == case.q_nope.dtype else "fp8"
    return compare_runs(case, impl, TorchMlaImpl(), tolerance(case.q_nope.dtype, kv))
