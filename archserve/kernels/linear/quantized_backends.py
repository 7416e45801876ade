"""Linear backends for the quantized GEMM kernels of this build (Triton and torch._scaled_mm).

Each executes the weight formats of archserve.kernels.linear.formats (FP8, FP8_BLOCK, INT8,
WNA16, MXFP4) through one routine, ``routine(x, weight, bias)``, whose weight is the layout of
archserve.kernels.linear.quantized_weights that archserve.quant repacks at load:

* TRITON_WEIGHT_ONLY - integer-group (wna16), FP8 and MXFP4 weights executed weight-only: the
  weight is dequantized in registers, the activations stay 16-bit. FP8 bytes are decoded
  with integer operations, so it runs where FP8 hardware does not (SM70-SM88).
* TORCH_SCALED_MM - FP8 W8A8 with per-channel weight scales through torch._scaled_mm
  (row-wise scales); the activations are quantized by a Triton kernel.
* TRITON_BLOCK_FP8 - FP8 W8A8 with 128x128 weight blocks and per-token-per-128-channel
  activation scales, on FP8 tensor cores (tl.float8e4nv).
* TRITON_INT8 - INT8 W8A8 with an int8 tl.dot.
  All three: at decode rows the start-up tuner may give a layer the weight-only kernel's
  GEMV with the activation quantization in its registers instead, where it timed faster.
* CPU_WEIGHT_ONLY - integer-group weights on a CPU, stored as int4, int8, bf16 or fp32,
  whichever this CPU multiplies fastest per shape (torch's CPU weight-only kernels).
"""

from __future__ import annotations

import torch

from archserve.kernels.linear.formats import (
    FP8,
    FP8_BLOCK,
    INT8,
    MXFP4,
    WNA16,
    QuantGemmBackend,
)
from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_STATIC_TENSOR,
)
from archserve.kernels.rules import (
    bf16_on_device,
    device_text,
    dtype_name,
    needs_capability,
    needs_dtype,
    runtime_at_least,
)
from archserve.kernels.specs import LinearSpec
from archserve.platform.capability import SM70, SM80, SM89, SM90
from archserve.platform.device import DeviceInfo

_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PER_TOKEN_OR_TENSOR = frozenset({ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR})


def _activations_rule(device: DeviceInfo, spec: LinearSpec) -> str | None:
    return needs_dtype(spec.dtype, _ACTIVATION_DTYPES) or bf16_on_device(device, spec.dtype)


def _w8a8_activations_rule(spec: LinearSpec) -> str | None:
    # bf16 needs no rule of its own: every device these backends accept has it.
    return needs_dtype(spec.dtype, _ACTIVATION_DTYPES)


def _cuda_or_rocm(device: DeviceInfo, minimum) -> str | None:
    """CUDA at ``minimum`` or more, or any ROCm GPU (Triton's AMD backend)."""
    if device.platform == "rocm":
        return None
    if device.platform != "cuda":
        return f"needs a CUDA or ROCm GPU, device is {device_text(device)}"
    return needs_capability(device, minimum)


class TritonWeightOnlyBackend(QuantGemmBackend):
    name = "TRITON_WEIGHT_ONLY"
    implemented = True
    library = "triton"
    formats = frozenset({WNA16, FP8, FP8_BLOCK, MXFP4})
    activations = None          # weight-only: any checkpoint's scheme, x stays 16-bit
    description = ("Triton weight-only GEMM: 4/8-bit integer groups, FP8 or MXFP4 dequantized "
                   "in registers, 16-bit activations (SM70+, ROCm; MXFP4 SM80+)")
    impl_path = "archserve.kernels.linear.triton_weight_only:WeightOnlyLinear"

    def device_rule(self, device: DeviceInfo) -> str | None:
        # Triton's SM70/SM75 tl.dot runs on FMA units: correct, not fast.
        return _cuda_or_rocm(device, SM70)

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        reason = super().request_rule(device, spec) or _activations_rule(device, spec)
        if reason is None and spec.quant_scheme == MXFP4 and device.is_cuda \
                and not device.has_capability(SM80):
            # As the MoE's: MXFP4 tiles feed bf16 MMAs; fp16 cannot hold every e8m0 scale.
            return f"MXFP4 weights need SM80+ (bf16), device is {device_text(device)}"
        return reason


class TorchScaledMmBackend(QuantGemmBackend):
    name = "TORCH_SCALED_MM"
    implemented = True
    library = "triton"          # the activation quantization kernel
    formats = frozenset({FP8})
    activations = _PER_TOKEN_OR_TENSOR
    description = ("torch._scaled_mm W8A8 FP8 with row-wise scales, activations quantized by "
                   "Triton (SM89+)")
    impl_path = "archserve.kernels.linear.fp8_gemm:ScaledMmFp8Linear"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM89)

    def runtime_rule(self, device: DeviceInfo) -> str | None:
        # cuBLASLt's FP8 matmuls: CUDA 12.0 on Hopper, 12.4 on Ada (as CUTLASS_FP8).
        return runtime_at_least(device, (12, 0) if device.has_capability(SM90) else (12, 4))

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        reason = super().request_rule(device, spec) or _w8a8_activations_rule(spec)
        if reason:
            return reason
        if spec.in_features % 16 or spec.out_features % 16:
            return (f"torch._scaled_mm needs in and out features divisible by 16, "
                    f"the layer is {spec.in_features} -> {spec.out_features}")
        return None


class TritonBlockFp8Backend(QuantGemmBackend):
    name = "TRITON_BLOCK_FP8"
    implemented = True
    library = "triton"
    formats = frozenset({FP8_BLOCK})
    activations = frozenset({ACT_DYNAMIC_GROUP})
    description = ("Triton block-FP8 W8A8 GEMM: 128x128 weight blocks, per-token-per-128 "
                   "activation scales, FP8 tensor cores (SM89+)")
    impl_path = "archserve.kernels.linear.fp8_gemm:BlockFp8Linear"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM89)

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        reason = super().request_rule(device, spec) or _w8a8_activations_rule(spec)
        if reason:
            return reason
        if spec.in_features % 128:
            return f"needs in features divisible by 128, the layer has {spec.in_features}"
        return None


class TritonInt8Backend(QuantGemmBackend):
    name = "TRITON_INT8"
    implemented = True
    library = "triton"
    formats = frozenset({INT8})
    activations = _PER_TOKEN_OR_TENSOR
    description = ("Triton INT8 W8A8 GEMM: int8 tl.dot, per-token or per-tensor activation "
                   "scales (SM80+, ROCm)")
    impl_path = "archserve.kernels.linear.int8_gemm:Int8Linear"

    def device_rule(self, device: DeviceInfo) -> str | None:
        # Triton emits int8 mma for SM80+ only: on SM70/SM75 an int8 tl.dot does not
        # compile. On ROCm it is MFMA i8 (compiled for gfx90a and gfx942).
        return _cuda_or_rocm(device, SM80)

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        return super().request_rule(device, spec) or _w8a8_activations_rule(spec)


class CpuWeightOnlyBackend(QuantGemmBackend):
    name = "CPU_WEIGHT_ONLY"
    implemented = True
    formats = frozenset({WNA16})
    activations = None
    description = ("a bfloat16 model's integer-group weights kept packed on a CPU: int4 / "
                   "int8 (torch's weight-only kernels, AVX2+), dense bf16 (AVX-512 BF16, "
                   "AMX) or fp32, whichever start-up timing finds fastest per shape")
    impl_path = "archserve.kernels.linear.cpu_weight_only:CpuWeightOnlyLinear"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform != "cpu":
            return f"CPU only, device is {device_text(device)}"
        if not device.features.avx2:
            return "needs AVX2 (torch's int4/int8 CPU kernels are scalar without it)"
        return None

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        # Its kernels round x to bfloat16: a float32 model keeps float32's exactness and
        # takes TORCH_DEQUANT (the expansion), a bfloat16 one has already chosen rounding.
        if (reason := super().request_rule(device, spec)) is not None:
            return reason
        if spec.dtype != torch.bfloat16:
            return (f"takes bfloat16 activations (torch's int4/int8 CPU kernels), "
                    f"requested {dtype_name(spec.dtype)}: TORCH_DEQUANT keeps it exact")
        return None


QUANTIZED_LINEAR_BACKENDS = (TorchScaledMmBackend, TritonBlockFp8Backend, TritonInt8Backend,
                             TritonWeightOnlyBackend, CpuWeightOnlyBackend)
