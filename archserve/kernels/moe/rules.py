"""Fused-MoE backends (op ``moe``) and the priority of seed 000 §4.

``MoESpec.quant_scheme`` uses the weight-format vocabulary of
archserve.kernels.linear.rules (None, fp8, fp8_block, nvfp4, mxfp8, mxfp4, wna16, int8).
TRITON_FUSED_MOE (16-bit, FP8 per-channel / per-tensor / block, W4A16 / W8A16
integer-group, and MXFP4 experts: weight-only, decoded in registers) and the torch fallback
(any of those, dequantized once) run in this build; the others are rules only: they can be
the ideal, never the route.
"""

from __future__ import annotations

import math

import torch

from archserve.kernels.linear.quantized_weights import ACT_STATIC_TENSOR
from archserve.kernels.rules import (
    FamilyGated,
    RuleBackend,
    backend_class,
    bf16_on_device,
    device_text,
    needs_capability,
    needs_cuda,
    needs_dtype,
    needs_family,
)
from archserve.kernels.specs import MoESpec
from archserve.platform.capability import SM75, SM80, SM89, SM90, SM100
from archserve.platform.device import DeviceInfo

_IMPL = "archserve.kernels.moe"
# Expert formats a kernel of this build executes (TRITON_FUSED_MOE, and TORCH_MOE after
# dequantizing them); the loader and quant/plan.py refuse the rest.
RUNNABLE_EXPERT_FORMATS = frozenset({None, "fp8", "fp8_block", "wna16", "mxfp4"})


FP8_BLOCK = 128      # the checkpoints' fp8 block (rows and columns)
MIN_REFINED_BLOCK = 32


def refined_fp8_block(spec: MoESpec) -> int | None:
    """vLLM 0.33 refines 128x128 fp8 expert blocks when one rank's intermediate width is
    not a whole number of blocks (tensor parallelism): the scales are upsampled to the
    largest block (>= 32) dividing the blocks, that width and the hidden size. None: the
    blocks stay 128x128 (or cannot be refined, and are padded to the shard instead)."""
    if spec.quant_scheme != "fp8_block":
        return None
    per_rank = spec.intermediate_per_rank
    tp = 1 if spec.expert_parallel else spec.tensor_parallel_size
    if per_rank % FP8_BLOCK == 0 and (tp == 1 or per_rank % FP8_BLOCK == 0):
        return None
    block = math.gcd(FP8_BLOCK, per_rank, spec.hidden_size)
    return block if block >= MIN_REFINED_BLOCK else None


class MoEBackend(RuleBackend):
    op = "moe"
    implemented = False
    formats: frozenset[str | None] = frozenset()
    # vLLM 0.33's _supports_batch_invariance: its Triton experts (and CUTLASS FP4) only.
    batch_invariant = False
    # Reads fp8 block scales of any block shape (vLLM: the Triton-based experts only).
    any_fp8_block = False

    def hardware_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        # The format decides first: "this layer is unquantized" explains more than an SM.
        return self.request_rule(device, spec) or self.device_rule(device)

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.quant_scheme not in self.formats:
            names = ", ".join(sorted("bf16/fp16" if f is None else f for f in self.formats))
            have = spec.quant_scheme or "unquantized"
            return f"executes {names} experts; this model's experts are {have}"
        if spec.batch_invariant and not self.batch_invariant:
            return "batch-invariant mode unsupported (vLLM 0.33: the Triton experts only)"
        block = refined_fp8_block(spec)
        if block and not self.any_fp8_block:
            return (f"reads 128x128 fp8 blocks only; one rank's intermediate width "
                    f"{spec.intermediate_per_rank} refines them to {block}x{block}")
        return None


class TritonFusedMoEBackend(MoEBackend):
    name = "TRITON_FUSED_MOE"
    library = "triton"
    implemented = True
    graph_capturable = True
    batch_invariant = True
    any_fp8_block = True
    formats = frozenset({None, "fp8", "fp8_block", "int8", "wna16", "mxfp4"})
    description = ("Triton fused MoE: token-sorted grouped GEMMs, gate/up with its activation "
                   "fused, then down scaled by the routing weights (any CUDA or ROCm GPU; "
                   "MXFP4 experts decoded in registers, SM80+)")
    impl_path = f"{_IMPL}.triton_fused_impl:TritonFusedMoEImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform not in ("cuda", "rocm"):
            return f"needs a CUDA or ROCm GPU, device is {device_text(device)}"
        return None

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        """vLLM 0.33 experts/triton_moe.py TritonExperts._supports_quant_scheme: fp8 needs
        ``supports_fp8()`` (SM89+), int8 SM75+ (any ROCm GPU); 16-bit runs everywhere."""
        reason = super().request_rule(device, spec)
        if reason or not device.is_cuda:
            return reason
        if spec.quant_scheme in ("fp8", "fp8_block") and not device.has_capability(SM89):
            return f"fp8 experts need SM89+, device is {device_text(device)}"
        if spec.quant_scheme == "int8" and not device.has_capability(SM75):
            return f"int8 experts need SM75+, device is {device_text(device)}"
        if spec.quant_scheme == "mxfp4" and not device.has_capability(SM80):
            # Decoded tiles feed bf16 tensor cores; in fp16 the e8m0 scales can leave its
            # range (vLLM's own MXFP4 floor is Marlin's SM75).
            return f"MXFP4 experts need SM80+ (bf16), device is {device_text(device)}"
        return None

    def build_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.batch_invariant:
            return "batch-invariant mode is not implemented in this build's Triton fused MoE"
        if spec.quant_scheme not in RUNNABLE_EXPERT_FORMATS:
            return (f"this build's Triton fused MoE runs 16-bit, fp8, fp8_block, wna16 and "
                    f"mxfp4 experts; {spec.quant_scheme} experts are rules only")
        return (needs_dtype(spec.dtype, (torch.float16, torch.bfloat16, torch.float32))
                or bf16_on_device(device, spec.dtype))


def _cap_in(device: DeviceInfo, low: int, high: int, what: str) -> str | None:
    """CUDA with low <= SM < high (capabilities as vLLM's integers, 90 for SM90)."""
    reason = needs_cuda(device)
    if reason:
        return reason
    cap = device.capability.to_int()
    if not low <= cap < high:
        return f"{what} covers SM{low} <= SM < SM{high}, device is {device_text(device)}"
    return None


def _sm90_or_families(device: DeviceInfo, *families: int) -> str | None:
    """SM90 exactly (not SM9x at large) or one of ``families``: vLLM's
    ``is_device_capability(90) or is_device_capability_family(...)``."""
    reason = needs_family(device, 90, *families)
    if reason is None and device.family == 90 and device.capability != SM90:
        return f"needs SM90 exactly, device is {device_text(device)}"
    return reason


class FlashInferSm100MoEBackend(MoEBackend, FamilyGated):
    """FlashInfer's TRT-LLM and CuteDSL MoE kernels: data-centre Blackwell (SM100 family)."""

    library = "flashinfer"
    families = (100,)


class TrtllmMoEBf16Backend(FlashInferSm100MoEBackend):
    """vLLM 0.33 experts/trtllm_bf16_moe.py: TrtLlmBf16Experts (SM100 family, <= 2048 experts)."""

    name = "TRTLLM_MOE_BF16"
    formats = frozenset({None})
    description = "FlashInfer TRT-LLM bf16 MoE (SM100 family)"

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.num_experts > 2048:
            return f"routes at most 2048 experts, this model has {spec.num_experts}"
        return super().request_rule(device, spec)


class CutlassMoEFp8Backend(MoEBackend):
    """vLLM 0.33 experts/cutlass_moe.py CutlassExpertsFp8: ``cutlass_group_gemm_supported``
    (_custom_ops.py) is 90 <= SM < 110; per-channel or per-tensor fp8, not block."""

    name = "CUTLASS_MOE_FP8"
    formats = frozenset({"fp8"})
    description = "vLLM CUTLASS grouped-GEMM FP8 MoE (SM90 <= SM < SM110)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _cap_in(device, 90, 110, "the CUTLASS grouped GEMM")


class TrtllmMoEFp8Backend(FlashInferSm100MoEBackend):
    """vLLM 0.33 experts/trtllm_fp8_moe.py: block fp8, per-tensor static fp8, mxfp8."""

    name = "TRTLLM_MOE_FP8"
    formats = frozenset({"fp8", "fp8_block", "mxfp8"})
    description = "FlashInfer TRT-LLM FP8 MoE (SM100 family)"

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.quant_scheme == "fp8" and spec.activation != ACT_STATIC_TENSOR:
            return "takes per-tensor fp8 experts with static activation scales only"
        return super().request_rule(device, spec)


# FlashInfer's SM100-family MoE kernels that differ in name, formats and text alone
# (vLLM 0.33 oracle/nvfp4.py and oracle/mxfp4.py, FLASHINFER_TRTLLM_MXFP4_*).
TrtllmMoENvfp4Backend, TrtllmMoEMxfp4Backend, FlashInferCuteDslMoEBackend = (
    backend_class(FlashInferSm100MoEBackend, name, formats=frozenset(formats),
                  description=description)
    for name, formats, description in (
        ("TRTLLM_MOE_NVFP4", {"nvfp4"}, "FlashInfer TRT-LLM NVFP4 MoE (SM100 family)"),
        ("TRTLLM_MOE_MXFP4", {"mxfp4"}, "FlashInfer TRT-LLM MXFP4 MoE (SM100 family)"),
        ("FLASHINFER_CUTEDSL_MOE", {"nvfp4"}, "FlashInfer CuteDSL MoE (SM100 family)"),
    ))


class FlashInferCutlassMoEBackend(MoEBackend):
    """vLLM 0.33 experts/flashinfer_cutlass_moe.py FlashInferExperts: SM90 exactly or the
    SM100/SM120 families (SM110 excluded), then a floor per scheme."""

    name = "FLASHINFER_CUTLASS_MOE"
    library = "flashinfer"
    formats = frozenset({None, "fp8", "fp8_block", "nvfp4", "mxfp4"})
    description = "FlashInfer CUTLASS MoE (SM90, SM100 and SM120 families)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _sm90_or_families(device, 100, 120)

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        reason = super().request_rule(device, spec)
        if reason:
            return reason
        fmt = spec.quant_scheme
        if fmt == "fp8" and spec.activation != ACT_STATIC_TENSOR:
            return "takes per-tensor fp8 experts with static activation scales only"
        if fmt in ("fp8_block", "mxfp4") and device.capability != SM90:
            # fp8 block and mxfp4 with 16-bit activations: the Hopper kernels only.
            return f"runs {fmt} experts on SM90 only, device is {device_text(device)}"
        if fmt == "nvfp4" and not device.has_capability(SM100):
            return f"runs nvfp4 experts from SM100, device is {device_text(device)}"
        return None


class DeepGemmMoEBackend(MoEBackend):
    """vLLM 0.33 platforms/cuda.py ``support_deep_gemm``: SM90 exactly, the SM100 and SM120
    families (the seed's table says no on SM12x; vLLM 0.33 enables it there)."""

    name = "DEEPGEMM_MOE"
    library = "deep_gemm"
    formats = frozenset({"fp8_block"})
    description = "DeepGEMM block-FP8 grouped GEMM (SM90, SM100 and SM120 families)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _sm90_or_families(device, 100, 120)


class TritonMxfp4MoEBackend(MoEBackend):
    """vLLM 0.33 experts/gpt_oss_triton_kernels_moe.py: OpenAI's triton_kernels MXFP4 MoE,
    ``_triton_kernel_moe_supports_current_device``: 9.0 <= SM < 13.0."""

    name = "TRITON_MXFP4_MOE"
    library = "triton_kernels"
    formats = frozenset({"mxfp4"})
    description = "OpenAI triton_kernels MXFP4 MoE (9.0 <= SM < 13.0)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _cap_in(device, 90, 130, "OpenAI's Triton MXFP4 kernels")


class MarlinMoEBackend(MoEBackend):
    name = "MARLIN_MOE"
    formats = frozenset({"wna16", "fp8", "fp8_block", "nvfp4", "mxfp4", "mxfp8"})
    description = "Marlin weight-only MoE (SM75+)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM75)


class TorchMoEBackend(RuleBackend):
    """Loop over the routed experts with torch matmuls: the universal fallback."""

    name = "TORCH_MOE"
    op = "moe"
    description = ("plain PyTorch loop over the experts that got tokens (any device; the "
                   "reference every MoE kernel is tested against; quantized experts are "
                   "dequantized once at start-up, no memory saving, and W8A8 activations "
                   "still quantized)")
    impl_path = f"{_IMPL}.torch_moe:TorchMoEImpl"

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.quant_scheme not in RUNNABLE_EXPERT_FORMATS:
            return (f"dequantizes fp8, fp8_block, wna16 and mxfp4 experts; "
                    f"{spec.quant_scheme} experts need a quantized MoE kernel")
        return None

    def build_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.batch_invariant:
            return "batch-invariant mode is not implemented in archserve's torch MoE"
        return None


MOE_BACKENDS: tuple[type[RuleBackend], ...] = (
    TrtllmMoEBf16Backend, TritonFusedMoEBackend, CutlassMoEFp8Backend, TrtllmMoEFp8Backend,
    TrtllmMoENvfp4Backend, TrtllmMoEMxfp4Backend, FlashInferCutlassMoEBackend,
    FlashInferCuteDslMoEBackend, DeepGemmMoEBackend, TritonMxfp4MoEBackend, MarlinMoEBackend,
    TorchMoEBackend,
)
MOE_FALLBACK = TorchMoEBackend.name

# vLLM 0.33 oracle/unquantized.py _get_priority_backends (CUDA; BATCHED_TRITON is the
# batched-activation form of TRITON, the same kernel family here).
_BF16_ORDER = ["TRTLLM_MOE_BF16", "FLASHINFER_CUTLASS_MOE", "TRITON_FUSED_MOE"]
# vLLM 0.33 oracle/fp8.py _get_priority_backends (AITER, ROCm-only, is not registered;
# the batched and HUMMING variants are not modelled). VLLM_CUTLASS is in the order for
# compressed-tensors and online fp8 (allow_vllm_cutlass=True), not for the HF fp8 method.
_FP8_ORDER = ["TRTLLM_MOE_FP8", "FLASHINFER_CUTLASS_MOE", "DEEPGEMM_MOE", "CUTLASS_MOE_FP8",
              "TRITON_FUSED_MOE", "MARLIN_MOE"]
# vLLM 0.33 oracle/nvfp4.py select_nvfp4_moe_backend (VLLM_CUTLASS FP4 not modelled).
_NVFP4_ORDER = ["TRTLLM_MOE_NVFP4", "FLASHINFER_CUTEDSL_MOE", "FLASHINFER_CUTLASS_MOE",
                "MARLIN_MOE"]
# vLLM 0.33 oracle/mxfp4.py _get_priority_backends_for_gpt_oss (16-bit-activation variants).
_MXFP4_ORDER = ["TRTLLM_MOE_MXFP4", "TRITON_MXFP4_MOE", "FLASHINFER_CUTLASS_MOE",
                "MARLIN_MOE"]
# vLLM 0.33 oracle/int_wna16.py _get_priority_backends (RDNA3 and TRT-LLM int4 not modelled).
_WNA16_ORDER = ["MARLIN_MOE", "TRITON_FUSED_MOE"]


def _move_to_back(order: list[str], name: str) -> list[str]:
    return [n for n in order if n != name] + [name]


def _move_to_front(order: list[str], name: str) -> list[str]:
    return [name] + [n for n in order if n != name]


def moe_priority(device: DeviceInfo, spec: MoESpec) -> list[str]:
    """The candidates in vLLM 0.33's order for this device and expert format."""
    fmt = spec.quant_scheme
    if fmt is None:
        if not device.is_cuda:
            return ["TRITON_FUSED_MOE"]     # ROCm: AITER (not registered), then Triton
        order = list(_BF16_ORDER)
        if device.family == 90:
            # "On Hopper (SM90), the FlashInfer unquantized MoE kernels are slower than Triton"
            order = _move_to_back(_move_to_back(order, "TRTLLM_MOE_BF16"),
                                  "FLASHINFER_CUTLASS_MOE")
        return order
    if fmt in ("fp8", "fp8_block"):
        order = list(_FP8_ORDER)
        if device.is_cuda and device.capability == SM90 and fmt == "fp8_block":
            # Hopper block FP8: Triton under EP = 1, FlashInfer CUTLASS under EP > 1.
            order = _move_to_front(order, "FLASHINFER_CUTLASS_MOE" if spec.expert_parallel
                                   else "TRITON_FUSED_MOE")
        return order
    if fmt == "nvfp4":
        return list(_NVFP4_ORDER)
    if fmt == "mxfp8":
        return ["TRTLLM_MOE_FP8", "MARLIN_MOE"]
    if fmt == "mxfp4":
        order = list(_MXFP4_ORDER)
        if device.family == 120:
            # Consumer Blackwell: the OAI Triton kernels' small tiles lose to Marlin.
            order = _move_to_back(order, "TRITON_MXFP4_MOE")
        # vLLM's list is rules only here; this build's Triton weight-only path runs them.
        return order + ["TRITON_FUSED_MOE"]
    if fmt == "wna16":
        return list(_WNA16_ORDER)
    return ["TRITON_FUSED_MOE"]
