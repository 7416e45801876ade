"""MLA attention backends (op ``mla_attention``, DeepSeek-style latent attention).

Capability ranges follow today's vLLM where it differs from seed 000 §2.2 (FlashMLA
and FlashMLA-sparse are Hopper and data-centre Blackwell, not Ada); see
docs/deviations.md. The fused library kernels are rules only (``explain`` shows an MLA
model's ideal route); TRITON_MLA (kernels/mla/triton_mla.py) and, for sparse MLA,
TRITON_MLA_SPARSE (kernels/mla/triton_sparse_mla.py) run on GPUs, and
TORCH_REFERENCE (kernels/mla/torch_mla.py) everywhere.
"""

from __future__ import annotations

import torch

from archserve.kernels.mla.decode_shared_memory import too_large_reason
from archserve.kernels.mla.interface import DECODE_ROWS_MAX_QUERY_LEN
from archserve.kernels.rules import (
    FamilyGated,
    RuleBackend,
    backend_class,
    bf16_on_device,
    block_size_rule,
    device_text,
    needs_cuda,
    needs_dtype,
    needs_family,
)
from archserve.kernels.specs import AttentionSpec
from archserve.platform.device import DeviceInfo

HALF_DTYPES = (torch.float16, torch.bfloat16)
DEEPSEEK_LATENT = (512, 64)   # (kv_lora_rank, qk_rope_head_dim) the fused kernels are built for


def _latent_rule(spec: AttentionSpec) -> str | None:
    if (spec.kv_lora_rank, spec.qk_rope_head_dim) != DEEPSEEK_LATENT:
        return (f"built for kv_lora_rank 512 + rope 64, model has "
                f"{spec.kv_lora_rank} + {spec.qk_rope_head_dim}")
    return None


class MlaBackend(FamilyGated):
    """Common request rules: an MLA spec, half-precision compute, dense vs sparse; the
    device rule is the SM families of ``families``.

    Block sizes follow vLLM 0.33 (v1/attention/backend.py, supports_block_size): a block
    is accepted when it is a multiple of one of the backend's advertised kernel sizes.
    """

    op = "mla_attention"
    sparse = False
    dsv4 = False                 # a DeepSeek V4 backend (kernels/compressed_attention/)
    kv_dtypes: tuple[str, ...] = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    fixed_latent = True          # fused kernels only exist for DeepSeek's latent sizes
    block_multiple: int | None = None
    head_sizes: tuple[int, ...] = ()   # the latent sizes its kernels take (empty: any)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if not spec.use_mla:
            return "serves MLA layers only; this layer is standard attention"
        if spec.compress_rate is not None and not self.dsv4:
            return (f"{self.name} is not a DeepSeek V4 attention backend (V4's compressed "
                    f"attention needs a *_DSV4 one)")
        if self.dsv4 and spec.compress_rate is None:
            return "DeepSeek V4 kernel; the model is not DeepSeek V4"
        if spec.mla_sparse and not self.sparse:
            return "the model uses sparse MLA; needs a *_SPARSE backend"
        if self.sparse and not spec.mla_sparse:
            return "sparse MLA kernel; the model uses dense MLA"
        kv = spec.kv_cache_dtype
        return ((f"head size {spec.head_size} unsupported "
                 f"({', '.join(map(str, self.head_sizes))})"
                 if self.head_sizes and spec.head_size not in self.head_sizes else None)
                or needs_dtype(spec.dtype, self.dtypes)
                or bf16_on_device(device, spec.dtype)
                or (_latent_rule(spec) if self.fixed_latent else None)
                or (f"{kv} KV cache unsupported" if kv not in self.kv_dtypes else None)
                or self.combination_rule(device, spec)
                or block_size_rule(spec.block_size, multiple_of=self.block_multiple))

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return None


class FlashInferMlaBackend(MlaBackend):
    name = "FLASHINFER_MLA"
    library = "flashinfer"
    implemented = False
    description = "FlashInfer MLA decode (SM100 family)"
    preferred_block_size = 64
    block_multiple = 32
    fixed_latent = False
    families = (100,)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        # vLLM 0.33 flashinfer_mla.py, FlashInferMLABackend.supports_combination.
        if spec.qk_nope_head_dim not in (64, 128, 192):
            return f"needs qk_nope_head_dim 64, 128 or 192, model has {spec.qk_nope_head_dim}"
        return None


# The rules-only MLA kernels that differ in data alone (SM families, dtypes, block sizes).
_SIXTEEN_BIT_KV = ("auto", "float16", "bfloat16")
_MLA_ROWS = (
    dict(name="CUTLASS_MLA", families=(100,), description="CUTLASS MLA (SM100 family)",
         preferred_block_size=128, block_multiple=128),
    dict(name="FLASH_ATTN_MLA", families=(90,), library="flash_attn", kv_dtypes=_SIXTEEN_BIT_KV,
         description="FlashAttention-3 MLA (Hopper)", block_multiple=16),
    # vLLM 0.33 ops/flashmla.py, is_flashmla_dense_supported: Hopper only (the SM100
    # family runs FlashMLA's sparse kernels, not its dense one).
    dict(name="FLASHMLA", families=(90,), description="FlashMLA dense (Hopper)",
         preferred_block_size=64, block_multiple=64),
)
(CutlassMlaBackend, FlashAttnMlaBackend, FlashMlaBackend) = (
    backend_class(MlaBackend, implemented=False, **row) for row in _MLA_ROWS)


# ---- sparse MLA (DeepSeek-V3.2, GLM-5): vLLM 0.33's backends, each as its
# supported_dtypes / supported_kv_cache_dtypes / get_supported_head_sizes /
# get_supported_kernel_block_sizes / supports_compute_capability / supports_combination
# (v1/attention/backends/mla/*sparse*.py) say.

class SparseMlaBackend(MlaBackend):
    sparse = True
    fixed_latent = False
    implemented = False
    preferred_block_size = 64
    block_multiple = 64
    head_sizes = (512, 576)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        reason = super().request_rule(device, spec)
        if reason is None and spec.index_topk is None:
            return "needs a model with index_topk (a sparse-MLA config)"
        return reason


def _nope_rule(spec: AttentionSpec) -> str | None:
    """FlashInfer's sparse kernels (TRT-LLM): NoPE models of one shape, else nope 128/192."""
    if spec.qk_rope_head_dim == 0:
        if (spec.qk_nope_head_dim, spec.kv_lora_rank) != (256, 512):
            return "a NoPE model needs qk_nope_head_dim 256 and kv_lora_rank 512"
    elif spec.qk_nope_head_dim not in (128, 192):
        return f"needs qk_nope_head_dim 128 or 192, model has {spec.qk_nope_head_dim}"
    return None


class FlashInferMlaSparseBackend(SparseMlaBackend):
    """flashinfer_mla_sparse.py, FlashInferMLASparseTRTLLMBackend."""

    name = "FLASHINFER_MLA_SPARSE"
    library = "flashinfer"
    kv_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    description = "FlashInfer sparse MLA, TRT-LLM kernels (SM100 family)"
    block_multiple = 32
    families = (100,)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _nope_rule(spec)


class FlashAttnMlaSparseFa4Backend(FlashInferMlaSparseBackend):
    """flashattn_mla_sparse.py, FlashAttnMLASparseFA4Backend: FA4 decode, the TRT-LLM
    kernels' rules besides."""

    name = "FLASH_ATTN_MLA_SPARSE_FA4"
    library = "flash_attn"
    dtypes = (torch.bfloat16,)
    kv_dtypes = ("auto", "bfloat16")
    description = "FlashAttention-4 sparse MLA decode (SM100 family)"
    block_multiple = 64
    head_sizes = (576,)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.index_topk is not None and spec.index_topk % 128:
            return f"needs index_topk a multiple of 128, model has {spec.index_topk}"
        if (spec.kv_lora_rank, spec.qk_rope_head_dim) != DEEPSEEK_LATENT:
            return (f"needs kv_lora_rank 512 + rope 64, model has {spec.kv_lora_rank} + "
                    f"{spec.qk_rope_head_dim}")
        if spec.num_heads not in (8, 16, 32, 64, 128):
            return f"needs 8, 16, 32, 64 or 128 query heads, this rank has {spec.num_heads}"
        return super().combination_rule(device, spec)


class FlashInferMlaSparseSm120Backend(SparseMlaBackend):
    """flashinfer_mla_sparse.py, FlashInferMLASparseSM120Backend."""

    name = "FLASHINFER_MLA_SPARSE_SM120"
    library = "flashinfer"
    dtypes = (torch.bfloat16,)
    kv_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
    description = "FlashInfer sparse MLA (RTX Blackwell, SM12x)"
    families = (120,)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.index_topk != 2048:
            return f"needs index_topk 2048, model has {spec.index_topk}"
        return None


class FlashInferMlaSparseSm90Backend(SparseMlaBackend):
    """flashinfer_mla_sparse_sm90.py, FlashInferMLASparseSM90Backend."""

    name = "FLASHINFER_MLA_SPARSE_SM90"
    library = "flashinfer"
    dtypes = (torch.bfloat16,)
    kv_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3")
    description = "FlashInfer sparse MLA (Hopper)"
    families = (90,)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.kv_lora_rank != 512 or spec.qk_rope_head_dim not in (0, 64):
            return "needs kv_lora_rank 512 and qk_rope_head_dim 0 or 64"
        return None


class FlashAttnMlaSparseBackend(SparseMlaBackend):
    """flashattn_mla_sparse.py, FlashAttnMLASparseBackend (FA3's MLA)."""

    name = "FLASH_ATTN_MLA_SPARSE"
    library = "flash_attn"
    kv_dtypes = ("auto", "float16", "bfloat16")
    description = "FlashAttention-3 sparse MLA (Hopper)"
    families = (90,)
    head_sizes = ()


class FlashMlaSparseBackend(SparseMlaBackend):
    """flashmla_sparse.py, FlashMLASparseBackend. A quantized cache is served as
    fp8_ds_mla ("fp8" an alias for it; nvfp4_ds_mla as it is). archserve names the --kv-
    cache-dtype "fp8" fp8_e4m3 (routing/dtypes.py), so that name stands for vLLM's "fp8"."""

    name = "FLASHMLA_SPARSE"
    dtypes = (torch.bfloat16,)
    kv_dtypes = ("auto", "bfloat16", "fp8_ds_mla", "fp8", "fp8_e4m3", "nvfp4_ds_mla")
    description = "FlashMLA sparse (Hopper and SM100 family)"
    families = (90, 100)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.head_size == 512:
            if not (device.family == 90 and spec.kv_cache_dtype in
                    ("auto", "bfloat16", "float16", "fp8_ds_mla")):
                return "head size 512 needs Hopper and a bf16 or fp8_ds_mla cache"
            if spec.qk_rope_head_dim != 0:
                return "head size 512 only for rope-free (NoPE) models"
        if spec.kv_cache_dtype == "nvfp4_ds_mla" and device.family != 100:
            return "nvfp4_ds_mla KV cache needs the SM100 family"
        return None


# vLLM 0.33's MLA kernels take the latent head sizes MLACommonBackend lists: DeepSeek's
# 512 + 64, and 256 + 64.
MLA_COMMON_HEAD_SIZES = (320, 576)


class TritonMlaBackend(MlaBackend):
    """vLLM 0.33 mla/triton_mla.py: any GPU, fp16/bf16, a 16-bit or e4m3 latent cache."""

    name = "TRITON_MLA"
    library = "triton"
    fixed_latent = False
    kv_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3")
    description = ("archserve's Triton MLA: absorbed decode over the latent cache (split-KV), "
                   "prompts expanded to per-head K/V through the Triton prefill (any GPU)")
    block_multiple = 16
    graph_capturable = True
    decode_rows_max_query_len = DECODE_ROWS_MAX_QUERY_LEN   # verification steps in graphs
    impl_path = "archserve.kernels.mla.triton_mla:TritonMlaImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform not in ("cuda", "rocm"):
            return f"needs a CUDA or ROCm GPU, device is {device_text(device)}"
        return None

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.head_size not in MLA_COMMON_HEAD_SIZES:
            return (f"latent head size {spec.head_size} unsupported "
                    f"({', '.join(map(str, MLA_COMMON_HEAD_SIZES))})")
        return None

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        # The decode kernel's latent tile must fit the GPU's shared memory (the ideal's
        # rules allow it; archserve's kernel is what needs the room).
        return too_large_reason(device, spec.kv_lora_rank)


class TritonMlaSparseBackend(TritonMlaBackend):
    """archserve's sparse MLA (no vLLM counterpart): the Triton indexer, top-k and indexed
    MLA decode (kernels/mla/triton_sparse_mla.py) where TRITON_MLA runs."""

    name = "TRITON_MLA_SPARSE"
    sparse = True
    # fp8 / fp8_e4m3 are served as fp8_ds_mla, as vLLM's FlashMLA sparse serves them.
    kv_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")
    description = ("archserve's Triton sparse MLA: the lightning indexer's scores and a "
                   "per-query top-k, then the MLA decode kernel over the selected latent "
                   "rows, decode and prompt rows alike (any GPU)")
    preferred_block_size = 64
    impl_path = "archserve.kernels.mla.triton_sparse_mla:TritonSparseMlaImpl"

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.qk_rope_head_dim <= 0:
            return "the decode kernel reads a rope part (qk_rope_head_dim > 0)"
        return None

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        from archserve.kernels.sparse_mla.layout import FP8_LATENT_NAMES
        return too_large_reason(device, spec.kv_lora_rank,
                                ds_mla=spec.kv_cache_dtype in FP8_LATENT_NAMES)


class ReferenceMlaBackend(MlaBackend):
    """The universal fallback: plain PyTorch latent attention (absorbed), any device."""

    name = "TORCH_REFERENCE"
    fixed_latent = False
    description = ("plain PyTorch MLA over the latent paged cache (absorbed W_UK/W_UV): "
                   "slow, exact, runs everywhere")
    impl_path = "archserve.kernels.mla.torch_mla:TorchMlaImpl"
    graph_capturable = False

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        from archserve.kernels.specs import RUNNABLE_KV_CACHE_DTYPES
        if spec.compress_rate is not None and spec.quantized_kv:
            return ("keeps DeepSeek V4's cache in the model dtype; a "
                    f"{spec.kv_cache_dtype} cache is not implemented for it")
        if spec.mla_sparse and spec.kv_cache_dtype == "fp8_ds_mla":
            return None      # the sparse cache rows' own format (kernels/sparse_mla/layout.py)
        if spec.kv_cache_dtype not in RUNNABLE_KV_CACHE_DTYPES:
            return f"KV cache dtype {spec.kv_cache_dtype} unsupported"
        return None


MLA_BACKENDS: tuple[type[RuleBackend], ...] = (
    FlashInferMlaBackend, CutlassMlaBackend, FlashAttnMlaBackend, FlashMlaBackend,
    FlashInferMlaSparseBackend, FlashInferMlaSparseSm90Backend, FlashInferMlaSparseSm120Backend,
    FlashMlaSparseBackend, FlashAttnMlaSparseBackend, FlashAttnMlaSparseFa4Backend,
    TritonMlaBackend, TritonMlaSparseBackend, ReferenceMlaBackend,
)
MLA_FALLBACK = ReferenceMlaBackend.name


def mla_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """vLLM 0.33's MLA order (platforms/cuda.py, _get_backend_priorities with use_mla), then
    archserve's sparse kernel (vLLM's fused sparse backends are rules only here: the ideal
    is vLLM's, the route TRITON_MLA_SPARSE)."""
    return _vllm_mla_priority(device, spec) + (["TRITON_MLA_SPARSE"] if device.is_gpu else [])


def _vllm_mla_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    if needs_cuda(device):
        return ["TRITON_MLA"] if device.is_gpu else []
    if device.family == 100:
        if spec.quantized_kv:
            sparse = ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        elif spec.num_heads <= 16:
            sparse = ["FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        else:
            sparse = ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
        return ["FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA",
                *sparse]
    if device.family == 120:
        return ["TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120"]
    sparse = ["FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"]
    if spec.head_size == 512:
        sparse.insert(0, "FLASHINFER_MLA_SPARSE_SM90")
    else:
        sparse.append("FLASHINFER_MLA_SPARSE_SM90")
    return ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", *sparse]


# MLA prefill (vLLM 0.33 platforms/interface.py, get_mla_prefill_backend_cls, and
# v1/attention/backends/mla/prefill/*): its own small selection over MLA dimensions
# (qk_nope_head_dim, qk_rope_head_dim, v_head_dim). Rules only here: archserve's prompts run
# inside the selected mla_attention implementation (mla_prefill_runs).
MLA_PREFILL_DIMENSIONS = {
    "FLASH_ATTN": ((128, 64, 128), (192, 64, 256), (64, 64, 128), (256, 0, 256)),
    "TRTLLM_RAGGED": ((128, 64, 128), (192, 64, 256)),
    "FLASHINFER": ((128, 64, 128),),
    "TOKENSPEED_MLA": ((128, 64, 128),),
}


def mla_prefill_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    if device.family == 100:
        if (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (192, 64, 256):
            return ["TRTLLM_RAGGED", "FLASH_ATTN", "FLASHINFER", "TOKENSPEED_MLA"]
        return ["FLASH_ATTN", "TRTLLM_RAGGED", "FLASHINFER", "TOKENSPEED_MLA"]
    return ["FLASH_ATTN"]


def mla_prefill_rule(name: str, device: DeviceInfo, spec: AttentionSpec) -> str | None:
    dims = (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim)
    if name != "FLASH_ATTN":
        reason = needs_family(device, 100)
        if reason:
            return reason
    elif not device.is_cuda:
        return f"needs an NVIDIA GPU (CUDA), device is {device_text(device)}"
    return (needs_dtype(spec.dtype, HALF_DTYPES)
            or (f"MLA dimensions {dims} unsupported"
                if dims not in MLA_PREFILL_DIMENSIONS[name] else None))


def mla_prefill_runs(mla_backend: str) -> str:
    """What runs MLA prompts under the selected mla_attention backend: TRITON_MLA expands the
    latent to per-head K/V for archserve's Triton prefill kernel (TRITON_ATTN's); the torch
    fallback attends over the latent, absorbed."""
    return "TRITON_ATTN" if mla_backend == "TRITON_MLA" else mla_backend
