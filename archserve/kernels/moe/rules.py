"""Fused-MoE backends (op ``moe``) and the priority of seed 000 §4.

``MoESpec.quant_scheme`` uses the weight-format vocabulary of
archserve.kernels.linear.rules (None, fp8, fp8_block, nvfp4, mxfp8, mxfp4, wna16, int8).
Only the torch fallback is implemented in this build.
"""

from __future__ import annotations

from archserve.kernels.rules import RuleBackend, device_text, needs_capability, needs_family
from archserve.kernels.specs import MoESpec
from archserve.platform.capability import SM75
from archserve.platform.device import DeviceInfo

_IMPL = "archserve.kernels.moe"


class MoEBackend(RuleBackend):
    op = "moe"
    implemented = False
    formats: frozenset[str | None] = frozenset()

    def hardware_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        # The format decides first: "this layer is unquantized" explains more than an SM.
        return self.request_rule(device, spec) or self.device_rule(device)

    def request_rule(self, device: DeviceInfo, spec: MoESpec) -> str | None:
        if spec.quant_scheme not in self.formats:
            names = ", ".join(sorted("bf16/fp16" if f is None else f for f in self.formats))
            have = spec.quant_scheme or "unquantized"
            return f"executes {names} experts; this model's experts are {have}"
        return None


class TritonFusedMoEBackend(MoEBackend):
    name = "TRITON_FUSED_MOE"
    library = "triton"
    formats = frozenset({None, "fp8", "fp8_block", "int8", "wna16", "mxfp4"})
    description = "Triton fused_moe (any CUDA or ROCm GPU)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform not in ("cuda", "rocm"):
            return f"needs a CUDA or ROCm GPU, device is {device_text(device)}"
        return None


class CutlassMoEFp8Backend(MoEBackend):
    name = "CUTLASS_MOE_FP8"
    formats = frozenset({"fp8"})
    description = "CUTLASS grouped-GEMM FP8 MoE (SM90, SM100, SM120 builds)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90, 100, 120)


class TrtllmMoEFp8Backend(MoEBackend):
    name = "TRTLLM_MOE_FP8"
    library = "flashinfer"
    formats = frozenset({"fp8", "fp8_block", "mxfp8"})
    description = "FlashInfer TRT-LLM FP8 MoE (SM100 family)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class TrtllmMoENvfp4Backend(MoEBackend):
    name = "TRTLLM_MOE_NVFP4"
    library = "flashinfer"
    formats = frozenset({"nvfp4"})
    description = "FlashInfer TRT-LLM NVFP4 MoE (SM100 family)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class FlashInferCutlassMoEBackend(MoEBackend):
    name = "FLASHINFER_CUTLASS_MOE"
    library = "flashinfer"
    formats = frozenset({"fp8", "nvfp4", "mxfp4"})
    description = "FlashInfer CUTLASS MoE (SM90/100/110/120)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90, 100, 110, 120)


class FlashInferCuteDslMoEBackend(MoEBackend):
    name = "FLASHINFER_CUTEDSL_MOE"
    library = "flashinfer"
    formats = frozenset({"nvfp4"})
    description = "FlashInfer CuteDSL MoE (SM100 family)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 100)


class DeepGemmMoEBackend(MoEBackend):
    name = "DEEPGEMM_MOE"
    library = "deep_gemm"
    formats = frozenset({"fp8_block"})
    description = "DeepGEMM block-FP8 grouped GEMM (Hopper; SM100 unverified)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, 90, 100)


class MarlinMoEBackend(MoEBackend):
    name = "MARLIN_MOE"
    formats = frozenset({"wna16", "fp8", "fp8_block", "nvfp4", "mxfp4"})
    description = "Marlin weight-only MoE (SM75+)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM75)


class TorchMoEBackend(RuleBackend):
    """Loop over the routed experts with torch matmuls: the universal fallback."""

    name = "TORCH_MOE"
    op = "moe"
    description = ("plain PyTorch expert loop over 16-bit experts (any device; the reference: "
                   "no MoE architecture loads in this build yet)")
    impl_path = f"{_IMPL}.torch_moe:TorchMoEImpl"


MOE_BACKENDS: tuple[type[RuleBackend], ...] = (
    TritonFusedMoEBackend, CutlassMoEFp8Backend, TrtllmMoEFp8Backend, TrtllmMoENvfp4Backend,
    FlashInferCutlassMoEBackend, FlashInferCuteDslMoEBackend, DeepGemmMoEBackend,
    MarlinMoEBackend, TorchMoEBackend,
)
MOE_FALLBACK = TorchMoEBackend.name

# Seed 000 §4.1 global FP8 order (AITER, ROCm-only, is not registered).
_FP8_ORDER = ["TRTLLM_MOE_FP8", "FLASHINFER_CUTLASS_MOE", "DEEPGEMM_MOE", "CUTLASS_MOE_FP8",
              "TRITON_FUSED_MOE", "MARLIN_MOE"]
# Seed 000 §4.4 NVFP4 order.
_NVFP4_ORDER = ["TRTLLM_MOE_NVFP4", "FLASHINFER_CUTEDSL_MOE", "FLASHINFER_CUTLASS_MOE",
                "MARLIN_MOE"]
_MXFP4_ORDER = ["FLASHINFER_CUTLASS_MOE", "TRITON_FUSED_MOE", "MARLIN_MOE"]


def _prefer(order: list[str], first: str, before: str | None = None) -> list[str]:
    """Move ``first`` to the front, or just ahead of ``before``."""
    rest = [n for n in order if n != first]
    at = rest.index(before) if before in rest else 0
    return rest[:at] + [first] + rest[at:]


def moe_priority(device: DeviceInfo, spec: MoESpec) -> list[str]:
    fmt = spec.quant_scheme
    if fmt in ("fp8", "fp8_block"):
        order = list(_FP8_ORDER)
        if device.family == 90 and fmt == "fp8_block":
            # Hopper block FP8: Triton is faster under TP; EP needs FlashInfer's batched layout.
            if spec.expert_parallel:
                order = _prefer(order, "FLASHINFER_CUTLASS_MOE")
            elif spec.tensor_parallel:
                order = _prefer(order, "TRITON_FUSED_MOE")
        if device.family == 100 and spec.num_tokens <= 8:
            # Tiny batches: CUTLASS grouped-GEMM launch overhead loses to one Triton kernel.
            order = _prefer(order, "TRITON_FUSED_MOE", before="CUTLASS_MOE_FP8")
        return order
    if fmt == "nvfp4":
        return list(_NVFP4_ORDER)
    if fmt == "mxfp8":
        return ["TRTLLM_MOE_FP8"]
    if fmt == "mxfp4":
        return list(_MXFP4_ORDER)
    if fmt == "wna16":
        return ["MARLIN_MOE", "TRITON_FUSED_MOE"]
    return ["TRITON_FUSED_MOE"]
