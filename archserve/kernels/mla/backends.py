"""MLA attention backends (op ``mla_attention``, DeepSeek-style latent attention).

Capability ranges follow today's vLLM where it differs from seed 000 §2.2 (FlashMLA
and FlashMLA-sparse are Hopper and data-centre Blackwell, not Ada); see
docs/deviations.md. archserve runs no MLA model yet: every backend here is rules only,
so ``explain`` shows an MLA model's ideal route and says it is not loadable.
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import (
    RuleBackend,
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


class MlaBackend(RuleBackend):
    """Common request rules: an MLA spec, half-precision compute, dense vs sparse."""

    op = "mla_attention"
    sparse = False
    fp8_kv = True
    fixed_latent = True          # fused kernels only exist for DeepSeek's latent sizes
    block_sizes: tuple[int, ...] | None = None
    block_multiple: int | None = None

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if not spec.use_mla:
            return "serves MLA layers only; this layer is standard attention"
        if spec.mla_sparse and not self.sparse:
            return "the model uses sparse MLA; needs a *_SPARSE backend"
        if self.sparse and not spec.mla_sparse:
            return "sparse MLA kernel; the model uses dense MLA"
        return (needs_dtype(spec.dtype, HALF_DTYPES)
                or bf16_on_device(device, spec.dtype)
                or (_latent_rule(spec) if self.fixed_latent else None)
                or ("fp8 KV cache unsupported" if spec.fp8_kv and not self.fp8_kv else None)
                or block_size_rule(spec.block_size, multiple_of=self.block_multiple,
                                   choices=self.block_sizes))


class FlashInferMlaBackend(MlaBackend):
    name = "FLASHINFER_MLA"
    library = "flashinfer"
    implemented = False
    description = "FlashInfer MLA decode (SM100 family)"
    preferred_block_size = 64
    block_sizes = (32, 64)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class CutlassMlaBackend(MlaBackend):
    name = "CUTLASS_MLA"
    implemented = False
    description = "CUTLASS MLA (SM100 family)"
    preferred_block_size = 128
    block_sizes = (128,)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class FlashAttnMlaBackend(MlaBackend):
    name = "FLASH_ATTN_MLA"
    library = "flash_attn"
    implemented = False
    fp8_kv = False
    description = "FlashAttention-3 MLA (Hopper)"
    block_multiple = 16

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90)


class FlashMlaBackend(MlaBackend):
    name = "FLASHMLA"
    implemented = False
    description = "FlashMLA (Hopper and SM100 family)"
    preferred_block_size = 64
    block_sizes = (64,)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90, 100)


class FlashInferMlaSparseBackend(MlaBackend):
    name = "FLASHINFER_MLA_SPARSE"
    library = "flashinfer"
    implemented = False
    sparse = True
    description = "FlashInfer sparse MLA (SM100 family)"
    preferred_block_size = 64
    block_sizes = (32, 64)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class FlashMlaSparseBackend(MlaBackend):
    name = "FLASHMLA_SPARSE"
    implemented = False
    sparse = True
    description = "FlashMLA sparse (Hopper and SM100 family)"
    preferred_block_size = 64
    block_sizes = (64,)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90, 100)


class TritonMlaBackend(MlaBackend):
    name = "TRITON_MLA"
    library = "triton"
    implemented = False
    fp8_kv = False
    fixed_latent = False
    description = "Triton MLA (any GPU)"
    block_multiple = 16

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform not in ("cuda", "rocm"):
            return f"needs a CUDA or ROCm GPU, device is {device_text(device)}"
        return None


class ReferenceMlaBackend(MlaBackend):
    """The fallback's place in the priority list; no MLA code exists in this build yet, so
    it is rules only and MLA selection names no route."""

    name = "TORCH_REFERENCE"
    fixed_latent = False
    implemented = False
    description = "plain PyTorch MLA (rules only: no MLA model runs in this build)"

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return None


MLA_BACKENDS: tuple[type[RuleBackend], ...] = (
    FlashInferMlaBackend, CutlassMlaBackend, FlashAttnMlaBackend, FlashMlaBackend,
    FlashInferMlaSparseBackend, FlashMlaSparseBackend, TritonMlaBackend, ReferenceMlaBackend,
)
MLA_FALLBACK = ReferenceMlaBackend.name


def mla_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """Seed 000 §2.1: the SM100 family list (sparse order by KV dtype and head count), else Hopper-first."""
    if needs_cuda(device):
        return ["TRITON_MLA"] if device.is_gpu else []
    if device.family == 100:
        if spec.fp8_kv or spec.num_heads <= 16:
            sparse = ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        else:
            sparse = ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
        return ["FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA",
                *sparse]
    return ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE"]
