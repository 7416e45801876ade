"""The weight formats linear and MoE kernels execute, and the base of a backend that
executes a fixed set of them.

A format is what a kernel reads, not a checkpoint's ``quant_method``: archserve.quant maps
methods to formats (AWQ and GPTQ are both ``wna16``; FBGEMM and ModelOpt FP8 are both
``fp8``). The backend tables (rules.py, quantized_backends.py) and archserve.quant import
this module; it imports none of them.
"""

from __future__ import annotations

from archserve.kernels.rules import RuleBackend
from archserve.kernels.specs import LinearSpec
from archserve.platform.device import DeviceInfo

# Weight formats (the vocabulary shared with archserve.quant and MoESpec).
FP8 = "fp8"                  # FP8 weights and activations, per-tensor/per-channel scales
FP8_BLOCK = "fp8_block"      # FP8 with 128x128 block scales (DeepSeek-V3 style)
INT8 = "int8"                # INT8 W8A8
WNA16 = "wna16"              # 4/8-bit integer weights, 16-bit activations (GPTQ, AWQ)
W4A8 = "w4a8"                # 4-bit weights, FP8 activations
NVFP4 = "nvfp4"
MXFP4 = "mxfp4"
MXFP8 = "mxfp8"
SPARSE_2_4 = "sparse_2_4"    # 2:4 structured-sparse FP8/INT8
BNB = "bnb"                  # bitsandbytes NF4 / int8
GROUPED = "grouped"          # grouped (per-expert) GEMM, reached from MoE layers
HADAMARD_FP4 = "hadamard_fp4"  # FP-Quant: Hadamard-rotated MXFP4/NVFP4 weights and activations
TORCHAO = "torchao"          # torchao's tensor subclasses (their own torch ops)

WEIGHT_FORMATS = (FP8, FP8_BLOCK, INT8, WNA16, W4A8, NVFP4, MXFP4, MXFP8, SPARSE_2_4, BNB,
                  GROUPED, HADAMARD_FP4, TORCHAO)


def format_text(fmt: str | None) -> str:
    return "unquantized" if fmt is None else fmt


class QuantGemmBackend(RuleBackend):
    """A GEMM kernel that executes a fixed set of weight formats."""

    op = "linear"
    implemented = False
    formats: frozenset[str] = frozenset()
    # The activation quantizations (quantized_weights.ACT_*) a W8A8 kernel is built for;
    # None: weight-only, it runs any checkpoint's weights with 16-bit activations.
    activations: frozenset[str] | None = None

    def hardware_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        # The format decides first: "this layer is unquantized" explains more than an SM.
        return self.request_rule(device, spec) or self.device_rule(device)

    def request_rule(self, device: DeviceInfo, spec: LinearSpec) -> str | None:
        if spec.quant_scheme not in self.formats:
            return (f"executes {', '.join(sorted(self.formats))} weights; "
                    f"this layer is {format_text(spec.quant_scheme)}")
        if self.activations is not None and spec.activation not in self.activations:
            wanted = " or ".join(a.replace("_", " ") for a in sorted(self.activations))
            return (f"quantizes activations {wanted}; the checkpoint's are "
                    f"{spec.activation.replace('_', ' ')}")
        return None
