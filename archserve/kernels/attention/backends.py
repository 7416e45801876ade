"""Attention backends (op ``attention``): each backend's rules in one class, and the priority list.

The priority list follows seed 000 §2.1 (vLLM's ``_get_backend_priorities``); where we
follow today's vLLM instead of the seed, docs/deviations.md says so.
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import (
    RuleBackend,
    bf16_on_device,
    block_size_rule,
    device_text,
    fp8_kv_on_device,
    needs_capability,
    needs_dtype,
    needs_gpu,
    triton_interpreted,
)
from archserve.kernels.specs import AttentionSpec
from archserve.platform.capability import SM80, SM121
from archserve.platform.device import DeviceInfo

HALF_DTYPES = (torch.float16, torch.bfloat16)
_IMPL = "archserve.kernels.attention"


def _not_mla(spec: AttentionSpec) -> str | None:
    if spec.use_mla:
        return "the model uses MLA; MLA layers select among mla_attention backends"
    return None


def _torch_at_least(device: DeviceInfo, major: int, minor: int) -> str | None:
    text = device.toolchain.torch_version or torch.__version__
    try:
        have = tuple(int(p) for p in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if have < (major, minor):
        return f"needs torch {major}.{minor}+, this build has {text}"
    return None


def flash_attn_version(device: DeviceInfo, spec: AttentionSpec) -> int:
    """Which FlashAttention generation runs here (seed 000 §2.3).

    FA3 is Hopper-only (it cannot run on Blackwell); FA4 is the default on the SM100
    family, limited by tensor memory to head sizes <= 128, exactly 256, or 192 with a
    128 value head; everything else SM80+ uses FA2.
    """
    family = device.family
    if family == 90:
        return 3
    if family == 100:
        value_head = spec.v_head_dim if spec.use_mla else spec.head_size
        if (spec.head_size <= 128 or spec.head_size == 256
                or (spec.head_size == 192 and value_head == 128)):
            return 4
    return 2


class FlashAttentionBackend(RuleBackend):
    name = "FLASH_ATTN"
    op = "attention"
    library = "flash_attn"
    implemented = False   # the flash_attn library is not on our GPU machine yet
    description = "FlashAttention (FA2 on SM8x/SM11x/SM12x, FA3 on Hopper, FA4 on SM100 family)"
    graph_capturable = True

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM80)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        version = flash_attn_version(device, spec)
        return (_not_mla(spec)
                or needs_dtype(spec.dtype, HALF_DTYPES)
                or bf16_on_device(device, spec.dtype)
                or (f"head size {spec.head_size} unsupported (multiples of 8 up to 256)"
                    if spec.head_size % 8 or spec.head_size > 256 else None)
                or (f"fp8 KV cache needs FA3 (Hopper); {device_text(device)} runs FA{version}"
                    if spec.fp8_kv and version != 3 else None)
                or block_size_rule(spec.block_size, multiple_of=16))

    def detail(self, device: DeviceInfo, spec: AttentionSpec) -> str:
        return f"FA{flash_attn_version(device, spec)}"


class FlashInferBackend(RuleBackend):
    name = "FLASHINFER"
    op = "attention"
    library = "flashinfer"
    implemented = False   # flashinfer is not on our GPU machine yet
    description = "FlashInfer paged attention (SM80..SM121)"
    graph_capturable = True

    def device_rule(self, device: DeviceInfo) -> str | None:
        # Today's vLLM: SM75 is listed by the seed, but FlashInfer is broken on Turing.
        reason = needs_capability(device, SM80)
        if reason:
            return reason
        if device.capability > SM121:
            return f"supports up to {SM121}, device is {device_text(device)}"
        return None

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return (_not_mla(spec)
                or needs_dtype(spec.dtype, HALF_DTYPES)
                or bf16_on_device(device, spec.dtype)
                or (f"head size {spec.head_size} unsupported (64, 128, 256)"
                    if spec.head_size not in (64, 128, 256) else None)
                or fp8_kv_on_device(device, spec.kv_cache_dtype)
                or block_size_rule(spec.block_size, choices=(16, 32, 64)))


TRITON_HEAD_SIZES = (64, 80, 96, 128, 256)


class TritonAttentionBackend(RuleBackend):
    name = "TRITON_ATTN"
    op = "attention"
    library = "triton"
    description = "archserve's Triton paged attention (any CUDA or ROCm GPU)"
    graph_capturable = True
    impl_path = f"{_IMPL}.triton_backend:TritonAttentionImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform in ("cuda", "rocm"):
            return None
        if device.platform == "cpu" and triton_interpreted():
            return None
        return "needs a GPU (runs on CPU only under TRITON_INTERPRET=1)"

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return (_not_mla(spec)
                or (f"head size {spec.head_size} unsupported "
                    f"({', '.join(map(str, TRITON_HEAD_SIZES))})"
                    if spec.head_size not in TRITON_HEAD_SIZES else None)
                or (bf16_on_device(device, spec.dtype) if device.is_gpu else None)
                or (fp8_kv_on_device(device, spec.kv_cache_dtype) if device.is_gpu else None)
                or block_size_rule(spec.block_size, multiple_of=16))


def _torch_attention_request_rule(device: DeviceInfo, spec: AttentionSpec) -> str | None:
    """The torch backends (flex, SDPA) dequantize an fp8 cache as they gather it and apply
    soft-capping themselves (flex: a score_mod; SDPA: the explicit-scores path), so only
    MLA and the dtype constrain them."""
    return _not_mla(spec) or (bf16_on_device(device, spec.dtype) if device.is_gpu else None)


class FlexAttentionBackend(RuleBackend):
    name = "FLEX_ATTENTION"
    op = "attention"
    description = "torch flex_attention with a paged block mask (any device, torch >= 2.5)"
    impl_path = f"{_IMPL}.flex_backend:FlexAttentionImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _torch_at_least(device, 2, 5)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _torch_attention_request_rule(device, spec)


class SdpaAttentionBackend(RuleBackend):
    name = "TORCH_SDPA"
    op = "attention"
    description = "torch scaled_dot_product_attention over gathered blocks (the CPU default)"
    impl_path = f"{_IMPL}.sdpa_backend:SdpaAttentionImpl"

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _torch_attention_request_rule(device, spec)


class ReferenceAttentionBackend(RuleBackend):
    name = "TORCH_REFERENCE"
    op = "attention"
    description = "plain PyTorch paged attention: slow, exact, runs everywhere"
    impl_path = f"{_IMPL}.reference:ReferenceAttentionImpl"


ATTENTION_BACKENDS: tuple[type[RuleBackend], ...] = (
    FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend,
    FlexAttentionBackend, SdpaAttentionBackend, ReferenceAttentionBackend,
)
ATTENTION_FALLBACK = ReferenceAttentionBackend.name


def attention_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """Seed 000 §2.1: data-centre Blackwell prefers FlashInfer; other CUDA FlashAttention."""
    if needs_gpu(device):
        return ["TORCH_SDPA", "FLEX_ATTENTION"]
    if device.platform == "rocm":
        return ["TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA"]
    if device.family == 100:
        return ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA"]
    return ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA"]
