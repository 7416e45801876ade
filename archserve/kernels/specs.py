"""Spec objects: what a request asks of an op kind, independent of any backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from archserve.kernels.registry import ATTENTION_TYPES  # noqa: F401 - re-exported


def batch_invariant_requested() -> bool:
    """vLLM's ``VLLM_BATCH_INVARIANT=1``: results must not depend on the batch's make-up
    (its selection drops the backends that cannot promise it)."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer kind of one model run."""

    head_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"          # "auto", "fp8", "fp8_e4m3", "fp8_e5m2" run here;
                                          # the rest of KV_CACHE_DTYPES are rules only
    block_size: int | None = None         # None: the backend's preferred size
    num_heads: int = 32
    num_kv_heads: int = 8
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    use_mla: bool = False
    mla_sparse: bool = False              # sparse (indexer) MLA, as in DeepSeek-V3.2
    # Sparse MLA: the keys a query attends to, the indexer key kept beside the latent, and
    # how that key is stored ("auto": the model dtype, or fp8 beside an fp8 latent; "fp8").
    index_topk: int | None = None
    index_head_dim: int = 0
    index_num_heads: int = 0
    index_cache_dtype: str = "auto"
    # DeepSeek V4's compressed attention (a sliding window with sinks, plus compressed
    # entries): the layer kind's compress rate, 0 for its sliding-window-only layers; None:
    # not a V4 layer. Its sparse (indexer) layers also set mla_sparse and index_*.
    compress_rate: int | None = None
    # MLA dimensions (DeepSeek-V3 defaults); head_size is kv_lora_rank + rope for MLA.
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    # What else vLLM selects on (vllm/v1/attention/selector.py, AttentionSelectorConfig).
    has_sinks: bool = False                # learned per-head attention sinks (gpt-oss)
    attn_type: str = "decoder"            # one of ATTENTION_TYPES
    non_causal: bool = False              # bidirectional attention over the paged cache
    batch_invariant: bool = False         # results must not depend on the batch's make-up
    per_head_kv_scales: bool = False      # per-head (not per-tensor) KV quantization scales
    fa_version: int | None = None         # force a FlashAttention generation (2, 3 or 4)

    @property
    def fp8_kv(self) -> bool:
        """A per-tensor-scaled fp8 cache (what archserve's kernels read)."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")

    @property
    def quantized_kv(self) -> bool:
        """Any KV cache not stored in 16 bits (fp8, int8/int4, nvfp4, turboquant, ...)."""
        return self.kv_cache_dtype not in ("auto", "float16", "bfloat16")


# Every --kv-cache-dtype vLLM 0.33 knows (vllm/config/cache.py, CacheDType). archserve's
# kernels read the first six; the others are rules only (explain shows their ideal).
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
    "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4", "nvfp4_4over6",
    "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
)
RUNNABLE_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer: dense (quant_scheme None) or one quantization scheme's GEMM."""

    dtype: torch.dtype = torch.bfloat16
    quant_scheme: str | None = None       # a weight format: "fp8", "fp8_block", "int8", "wna16"
    # How the checkpoint quantizes activations (quantized_weights.ACT_*): "none" for
    # weight-only schemes; a W8A8 kernel needs the scheme it was built for.
    activation: str = "none"
    group_size: int | None = None         # integer groups: channels per scale (-1: per channel)
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
    tensor_parallel_size: int = 1         # ranks of the tensor-parallel group
    expert_parallel: bool = False         # experts split over the ranks, whole per rank
    batch_invariant: bool = False         # VLLM_BATCH_INVARIANT: only kernels that promise it
    # How a quantized checkpoint quantizes the experts' activations (quantized_weights.ACT_*):
    # vLLM's MoE kernels accept different (weight, activation) pairs (kernels/moe/rules.py).
    activation: str = "dynamic_token"
    # What each expert computes between gate/up and down (expert_activation.py: "silu", or
    # gpt-oss's "swigluoai"), and whether it adds biases after its projections.
    gated_activation: str = "silu"
    expert_bias: bool = False

    @property
    def intermediate_per_rank(self) -> int:
        """Each expert's intermediate width on one rank: split by tensor parallelism,
        whole under expert parallelism (vLLM's intermediate_size_per_partition)."""
        if self.expert_parallel:
            return self.intermediate_size
        return self.intermediate_size // self.tensor_parallel_size

@dataclass(frozen=True)
class LoRASpec:
    """The LoRA adapters one engine serves: the delta its dense linears add per token."""

    dtype: torch.dtype = torch.bfloat16
    max_loras: int = 1                    # adapter slots of every layer
    max_lora_rank: int = 16
