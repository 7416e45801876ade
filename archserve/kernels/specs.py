"""Spec objects: what a request asks of an op kind, independent of any backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer kind of one model run."""

    head_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"          # "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    block_size: int | None = None         # None: the backend's preferred size
    num_heads: int = 32
    num_kv_heads: int = 8
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    use_mla: bool = False
    mla_sparse: bool = False              # sparse (indexer) MLA, as in DeepSeek-V3.2
    # MLA dimensions (DeepSeek-V3 defaults); head_size is kv_lora_rank + rope for MLA.
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer: dense (quant_scheme None) or one quantization scheme's GEMM."""

    dtype: torch.dtype = torch.bfloat16
    quant_scheme: str | None = None       # a weight format: "fp8", "fp8_block", "int8", "wna16"
    # How the checkpoint quantizes activations (quantized_weights.ACT_*): "none" for
    # weight-only schemes; a W8A8 kernel needs the scheme it was built for.
    activation: str = "none"
    in_features: int = 4096
    out_features: int = 4096


@dataclass(frozen=True)
class MoESpec:
    dtype: torch.dtype = torch.bfloat16
    quant_scheme: str | None = None       # None (bf16/fp16), "fp8", "fp8_block", "nvfp4", "mxfp8", "mxfp4", "wna16"
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_tokens: int = 256
    tensor_parallel: bool = False
    expert_parallel: bool = False
