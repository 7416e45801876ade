"""Linear / GEMM backends (op ``linear``): dense torch matmul and the quantized GEMM paths.

A `LinearSpec.quant_scheme` here is a *weight format* the kernels understand (formats.py).
Rules follow seed 000 §3 and the §5.3 matrix. This build implements the torch paths and, for dense layers on
GPUs, TRITON_SKINNY_GEMM (decode-sized GEMMs through a Triton GEMV where it measures
faster than cuBLAS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from archserve.kernels.linear.formats import (
    BNB,
    FP8,
    FP8_BLOCK,
    GROUPED,
    HADAMARD_FP4,
    INT8,
    MXFP4,
    MXFP8,
    NVFP4,
    SPARSE_2_4,
    TORCHAO,
    W4A8,
    WNA16,
    QuantGemmBackend,
)
from archserve.kernels.linear.quantized_backends import QUANTIZED_LINEAR_BACKENDS
from archserve.kernels.linear.torch_linear import torch_linear
from archserve.kernels.rules import (
    RuleBackend,
    backend_class,
    bf16_on_device,
    needs_capability,
    needs_dtype,
    needs_family,
    runtime_at_least,
)
from archserve.kernels.specs import LinearSpec
from archserve.platform.capability import SM60, SM75, SM89, SM90, SM100, Capability
from archserve.platform.device import DeviceInfo


def _torch_linear(device: DeviceInfo, spec: LinearSpec) -> Any:
    if device.platform == "cpu":   # a few rows in the form the CPU BLAS runs faster
        from archserve.kernels.linear.cpu_rows import CpuRowsLinear
        return CpuRowsLinear()
    return torch_linear


@dataclass(frozen=True)
class RulesOnlyGemm:
    """One of vLLM's quantized GEMM kernels that this build models as rules only: the
    backends differ in data alone (formats, SM floor or families, CUDA runtime)."""

    name: str
    formats: frozenset[str]
    description: str
    min_capability: Capability | None = None
    families: tuple[int, ...] = ()                 # SM families (90: Hopper, 100, 120)
    activations: frozenset[str] | None = None      # W8A8 kernels: the activation scales
    dtypes: tuple[torch.dtype, ...] | None = None  # the activation dtypes it computes in
    group_sizes: tuple[int, ...] | None = None     # integer groups it takes (-1: per channel)
    # (capability, CUDA runtime): the first row whose capability the device has (None:
    # any) gives the runtime this kernel's build needs (seed 000 §3.2).
    cuda_runtime: tuple[tuple[Capability | None, tuple[int, int]], ...] = ()


class RulesOnlyGemmBackend(QuantGemmBackend):
    """A backend built from a RulesOnlyGemm row (see ``_RULES_ONLY_GEMMS``)."""

    row: RulesOnlyGemm

    def device_rule(self, device: DeviceInfo) -> str | None:
        if self.row.families:
            return needs_family(device, *self.row.families)
        return needs_capability(device, self.row.min_capability)

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        sizes = self.row.group_sizes
        return super().request_rule(device, spec) or (
            needs_dtype(spec.dtype, self.row.dtypes) if self.row.dtypes else None) or (
            f"takes groups of {', '.join(map(str, sizes))} channels, the layer's are "
            f"{spec.group_size}"
            if sizes and spec.group_size is not None and spec.group_size not in sizes
            else None)

    def runtime_rule(self, device: DeviceInfo) -> str | None:
        for capability, version in self.row.cuda_runtime:
            if capability is None or device.has_capability(capability):
                return runtime_at_least(device, version)
        return None


_PER_TOKEN_OR_TENSOR = frozenset({"dynamic_token", "static_tensor"})
_BF16 = (torch.bfloat16,)
# Preference order is _QUANT_ORDER's, not this table's. The rows follow vLLM 0.33's linear
# kernels (model_executor/kernels/linear: each kernel's is_supported and can_implement).
_RULES_ONLY_GEMMS = (
    RulesOnlyGemm("FLASHINFER_CUTEDSL_NVFP4", frozenset({NVFP4}),
                  "FlashInfer CuTe-DSL NVFP4 GEMM (SM100 family)", families=(100,)),
    RulesOnlyGemm("FLASHINFER_CUTLASS_NVFP4", frozenset({NVFP4}),
                  "FlashInfer CUTLASS NVFP4 GEMM (SM100+)", min_capability=SM100),
    RulesOnlyGemm("FLASHINFER_CUTEDSL_MXFP8", frozenset({MXFP8}),
                  "FlashInfer CuTe-DSL MXFP8 GEMM (SM100 family)", families=(100,)),
    RulesOnlyGemm("FLASHINFER_CUTLASS_MXFP8", frozenset({MXFP8}),
                  "FlashInfer CUTLASS MXFP8 GEMM (SM100+)", min_capability=SM100),
    RulesOnlyGemm("FLASHINFER_MXFP4", frozenset({MXFP4}),
                  "FlashInfer CuTe-DSL MXFP4 W4A4 GEMM (SM100+)", min_capability=SM100,
                  activations=frozenset({"dynamic_group"})),
    RulesOnlyGemm("QUTLASS", frozenset({HADAMARD_FP4}),
                  "QuTLASS Hadamard-rotated FP4 GEMM (SM100 and SM120 families)",
                  families=(100, 120)),
    # FlashInfer's Hopper block-scale GEMM for small batches, DeepGEMM for the rest.
    RulesOnlyGemm("FLASHINFER_DEEPGEMM_BLOCK_FP8", frozenset({FP8_BLOCK}),
                  "FlashInfer SM90 block-FP8 GEMM, DeepGEMM above its batch size (Hopper, "
                  "bf16)", families=(90,), activations=frozenset({"dynamic_group"}),
                  dtypes=_BF16),
    RulesOnlyGemm("DEEPGEMM_BLOCK_FP8", frozenset({FP8_BLOCK}),
                  "DeepGEMM block-FP8 GEMM (SM90, SM100 and SM120 families, bf16)",
                  families=(90, 100, 120), activations=frozenset({"dynamic_group"}),
                  dtypes=_BF16),
    RulesOnlyGemm("FLASHINFER_FP8", frozenset({FP8}),
                  "FlashInfer FP8 GEMM, per-tensor weight and activation scales (SM100+)",
                  min_capability=SM100, activations=frozenset({"static_tensor"})),
    RulesOnlyGemm("MACHETE", frozenset({WNA16}),
                  "Machete mixed-input GEMM: integer weights, 16-bit activations (Hopper)",
                  families=(90,), group_sizes=(-1, 64, 128)),
    RulesOnlyGemm("EXLLAMA", frozenset({WNA16}),
                  "ExLlama GPTQ GEMM: 4/8-bit weights, float16 activations (SM60+)",
                  min_capability=SM60, dtypes=(torch.float16,)),
    RulesOnlyGemm("BITSANDBYTES", frozenset({BNB}),
                  "bitsandbytes NF4 / int8 matmul (any CUDA GPU)", min_capability=SM60),
    RulesOnlyGemm("TORCHAO", frozenset({TORCHAO}),
                  "torchao's quantized tensor ops (SM75+)", min_capability=SM75),
    RulesOnlyGemm("CUTLASS_NVFP4", frozenset({NVFP4}),
                  "CUTLASS NVFP4 GEMM (SM100 and SM120 families, separate builds)",
                  families=(100, 120), cuda_runtime=((None, (12, 8)),)),
    RulesOnlyGemm("CUTLASS_W4A8", frozenset({W4A8}),
                  "CUTLASS W4A8 mixed-precision GEMM (Hopper only)", families=(90,)),
    RulesOnlyGemm("CUTLASS_SPARSE_2_4", frozenset({SPARSE_2_4}),
                  "CUTLASS 2:4 structured-sparse GEMM (Hopper, SM100 family)",
                  families=(90, 100)),
    RulesOnlyGemm("CUTLASS_BLOCK_FP8", frozenset({FP8_BLOCK}),
                  "CUTLASS block-wise FP8 GEMM (SM90+)", min_capability=SM90,
                  activations=frozenset({"dynamic_group"}),
                  cuda_runtime=((SM100, (12, 8)), (None, (12, 0)))),
    # Ada's FP8 kernels need CUDA 12.4, Hopper's 12.0.
    RulesOnlyGemm("CUTLASS_FP8", frozenset({FP8}),
                  "CUTLASS W8A8 FP8 scaled_mm on FP8 tensor cores (SM89+)",
                  min_capability=SM89, activations=_PER_TOKEN_OR_TENSOR,
                  cuda_runtime=((SM90, (12, 0)), (None, (12, 4)))),
    RulesOnlyGemm("CUTLASS_INT8", frozenset({INT8}), "CUTLASS W8A8 INT8 scaled_mm (SM75+)",
                  min_capability=SM75, activations=_PER_TOKEN_OR_TENSOR),
    RulesOnlyGemm("CUTLASS_GROUPED_GEMM", frozenset({GROUPED}),
                  "CUTLASS grouped GEMM for expert layers (Hopper, SM100 family)",
                  families=(90, 100)),
    RulesOnlyGemm("MARLIN", frozenset({WNA16, FP8, FP8_BLOCK, NVFP4, MXFP4, MXFP8}),
                  "Marlin weight-only GEMM: dequantize in registers, FP16/BF16 tensor cores "
                  "(SM75+)", min_capability=SM75, group_sizes=(-1, 32, 64, 128)),
)


def _rules_only_backend(row: RulesOnlyGemm) -> type[RulesOnlyGemmBackend]:
    """A backend class per row, so the registry and priority code treat it like any other."""
    return backend_class(RulesOnlyGemmBackend, row.name, row=row, formats=row.formats,
                         activations=row.activations, description=row.description)


class TorchDequantBackend(RuleBackend):
    """The universal quantized path: the weight dequantized once at start-up, then torch."""

    name = "TORCH_DEQUANT"
    op = "linear"
    description = ("weights dequantized to the model dtype once at start-up, then torch matmul; "
                   "W8A8 activations quantized as the checkpoint says (any device; no memory "
                   "saving)")
    impl_path = "archserve.kernels.linear.torch_dequant:TorchDequantLinear"
    formats = frozenset({FP8, FP8_BLOCK, INT8, WNA16, MXFP4})

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        if spec.quant_scheme is None:
            return "nothing to dequantize: this layer is unquantized"
        if spec.quant_scheme not in self.formats:
            return (f"dequantizes {', '.join(sorted(self.formats))} weights; "
                    f"this layer is {spec.quant_scheme}")
        return None


class TritonSkinnyGemmBackend(RuleBackend):
    """Dense GEMMs of 1-16 rows (decode batches) in CUDA graphs through a Triton GEMV, per
    shape only where start-up timing shows it faster than cuBLAS; everything else is
    torch's. It never loses to TORCH_MATMUL by more than timing noise."""

    name = "TRITON_SKINNY_GEMM"
    op = "linear"
    library = "triton"
    description = ("Triton GEMV for decode GEMMs of 1-16 rows in CUDA graphs, per shape where "
                   "it times faster than cuBLAS; torch matmul otherwise (any CUDA/ROCm GPU)")
    impl_path = "archserve.kernels.linear.skinny_choice:SkinnyGemmRoutine"

    def device_rule(self, device: DeviceInfo) -> str | None:
        if device.platform in ("cuda", "rocm"):
            return None
        return "needs a GPU (its choice is timed inside CUDA graphs)"

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        if spec.quant_scheme is not None:
            return f"dense weights only; this layer is {spec.quant_scheme}"
        return (needs_dtype(spec.dtype, (torch.float16, torch.bfloat16, torch.float32))
                or bf16_on_device(device, spec.dtype))


class TorchMatmulBackend(RuleBackend):
    """Dense GEMM through torch (cuBLAS, hipBLAS, oneDNN/CPU): the universal fallback."""

    name = "TORCH_MATMUL"
    op = "linear"
    description = "torch.nn.functional.linear (cuBLAS / hipBLAS / CPU BLAS)"

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        if spec.quant_scheme is not None:
            return (f"weights are {spec.quant_scheme}-quantized; "
                    "needs a kernel that dequantizes them")
        return None

    def make_impl(self, device: DeviceInfo, spec: LinearSpec) -> Any:
        return _torch_linear(device, spec)


LINEAR_BACKENDS: tuple[type[RuleBackend], ...] = (
    *(_rules_only_backend(row) for row in _RULES_ONLY_GEMMS),
    TorchDequantBackend, TritonSkinnyGemmBackend, TorchMatmulBackend,
)
LINEAR_FALLBACK = TorchMatmulBackend.name

# Preference among the kernels that execute a format: native tensor-core paths (vLLM's
# CUTLASS kernels, rules only here, then this build's own) before the weight-only paths
# (Marlin, rules only; the Triton weight-only kernel), and the start-up dequantization
# last (seed 000 §5.2).
# Per format this is vLLM 0.33's order (kernels/linear/__init__.py, _POSSIBLE_*_KERNELS):
# FP8 block: FlashInfer+DeepGEMM, DeepGEMM, CUTLASS, Marlin, then Triton; integer groups:
# Machete, Marlin, ExLlama; NVFP4 / MXFP8: FlashInfer CuTe-DSL, FlashInfer CUTLASS, (vLLM's
# CUTLASS,) Marlin. This build's kernels sit where vLLM's of the same kind do.
_QUANT_ORDER = ("FLASHINFER_CUTEDSL_NVFP4", "FLASHINFER_CUTLASS_NVFP4", "CUTLASS_NVFP4",
                "FLASHINFER_CUTEDSL_MXFP8", "FLASHINFER_CUTLASS_MXFP8", "FLASHINFER_MXFP4",
                "QUTLASS", "CUTLASS_W4A8", "CUTLASS_SPARSE_2_4",
                "FLASHINFER_DEEPGEMM_BLOCK_FP8", "DEEPGEMM_BLOCK_FP8", "CUTLASS_BLOCK_FP8",
                "FLASHINFER_FP8", "CUTLASS_FP8", "TORCH_SCALED_MM", "CUTLASS_INT8",
                "TRITON_INT8", "CUTLASS_GROUPED_GEMM", "MACHETE", "MARLIN", "TRITON_BLOCK_FP8",
                "EXLLAMA", "TRITON_WEIGHT_ONLY", "BITSANDBYTES", "TORCHAO", "CPU_WEIGHT_ONLY",
                "TORCH_DEQUANT")


def linear_priority(device: DeviceInfo, spec: LinearSpec) -> list[str]:
    """Dense layers: the tuned skinny GEMM on GPUs, else torch; quantized ones try the
    kernels that know the format."""
    if spec.quant_scheme is None:
        return ["TRITON_SKINNY_GEMM", "TORCH_MATMUL"] if device.is_gpu else ["TORCH_MATMUL"]
    executes = {cls.name for cls in LINEAR_BACKENDS + QUANTIZED_LINEAR_BACKENDS
                if spec.quant_scheme in getattr(cls, "formats", ())}
    return [name for name in _QUANT_ORDER if name in executes]
