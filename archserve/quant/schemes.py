"""Quantization schemes (seed 000 §5.1): what each needs and which kernels can execute it.

``min_capability`` is today's vLLM ``get_min_capability()`` (docs/deviations.md lists
where the seed differs): the least SM where vLLM has a kernel path. What archserve runs
is decided per layer by archserve.quant.plan from the kernels this build has; which
schemes this build can load at all is archserve.quant.config's (``LOADABLE_METHODS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from archserve.kernels.linear import rules as fmt
from archserve.kernels.rules import device_text
from archserve.platform.capability import Capability
from archserve.platform.device import DeviceInfo


@dataclass(frozen=True)
class QuantScheme:
    name: str                              # HF quantization_config.quant_method
    display: str                           # the seed's row name
    min_capability: Capability
    weight_format: str | None              # the kernel vocabulary; None: dense after load
    moe_format: str | None                 # format of the expert weights
    native_backends: tuple[str, ...]       # the linear kernels that are the scheme's own path
    carries: str                           # what the checkpoint holds, for humans
    feature: str | None = None             # a Features flag the silicon must also have
    dequantized_at_load: bool = False      # archserve's GGUF loader turns it dense at load

    @property
    def loadable(self) -> bool:
        """Whether archserve's loader reads checkpoints of this scheme."""
        from archserve.quant.config import LOADABLE_METHODS
        return self.name in LOADABLE_METHODS or self.name in ("fp8_block", "w8a8_int8")

    def hardware_rule(self, device: DeviceInfo) -> str | None:
        """None if some kernel path for this scheme exists on the device (vLLM's notion)."""
        if not device.is_cuda:
            return f"{self.display} kernels need an NVIDIA GPU, device is {device_text(device)}"
        if not device.has_capability(self.min_capability):
            return f"{self.display} needs {self.min_capability}+, device is {device_text(device)}"
        if self.feature and not getattr(device.features, self.feature):
            return f"{self.display} needs {self.feature} tensor cores, device is {device_text(device)}"
        return None


def _cap(n: int) -> Capability:
    return Capability.parse(n)


SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("gguf", "GGUF", _cap(60), None, None, (),
                "k-quant / legacy ggml blocks", dequantized_at_load=True),
    QuantScheme("compressed-tensors", "compressed-tensors", _cap(70), None, None, (),
                "per-group config: fp8/int8 W8A8, fp8 block, packed int4/int8 W4A16/W8A16"),
    QuantScheme("gptq", "GPTQ", _cap(60), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4/int8 weights, group scales, fp16 activations"),
    QuantScheme("bitsandbytes", "BitsAndBytes", _cap(70), fmt.BNB, None, (),
                "NF4 / int8 weights"),
    QuantScheme("awq", "AWQ", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4 weights, group scales and zeros"),
    QuantScheme("awq_marlin", "AWQ-Marlin", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4 weights repacked for Marlin"),
    QuantScheme("gptq_marlin", "GPTQ-Marlin", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4/int8 weights repacked for Marlin"),
    # FP8's minimum is Turing because SM75-88 run it weight-only through Marlin (§5.2).
    QuantScheme("fp8", "FP8", _cap(75), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 e4m3 weights (+ dynamic fp8 activations), per-tensor/channel scales"),
    QuantScheme("fp8_block", "FP8 block-wise", _cap(75), fmt.FP8_BLOCK, fmt.FP8_BLOCK,
                ("CUTLASS_BLOCK_FP8",), "fp8 e4m3 weights with 128x128 block scales"),
    QuantScheme("fbgemm_fp8", "FBGEMM FP8", _cap(80), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 weights, per-channel scales"),
    # ModelOpt FP8 and MXFP8 reach SM80 weight-only through Marlin (vLLM 0.33's
    # ModelOptFp8Config / ModelOptMxFp8Config.get_min_capability); natively 89+ / SM100.
    QuantScheme("modelopt", "ModelOpt FP8", _cap(80), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 weights and activations, static scales"),
    QuantScheme("modelopt_fp4", "NVFP4", _cap(75), fmt.NVFP4, fmt.NVFP4, ("CUTLASS_NVFP4",),
                "nvfp4 e2m1 weights, fp8 block scales (Marlin weight-only below SM100)"),
    QuantScheme("modelopt_mxfp8", "ModelOpt MXFP8", _cap(80), fmt.MXFP8, fmt.MXFP8, (),
                "mxfp8 weights, e8m0 block scales (Marlin weight-only below SM100)"),
    QuantScheme("mxfp4", "MXFP4", _cap(80), fmt.MXFP4, fmt.MXFP4, ("MARLIN",),
                "mxfp4 e2m1 weights, e8m0 block scales"),
    QuantScheme("experts_int8", "Experts INT8", _cap(80), None, fmt.INT8, (),
                "int8 expert weights only (dense layers stay 16-bit)"),
    QuantScheme("w8a8_int8", "INT8 W8A8", _cap(75), fmt.INT8, fmt.INT8, ("CUTLASS_INT8",),
                "int8 weights and activations"),
    QuantScheme("w4a8", "W4A8", _cap(90), fmt.W4A8, None, ("CUTLASS_W4A8",),
                "int4 weights, fp8 activations"),
)}

ALIASES = {"compressed_tensors": "compressed-tensors", "modelopt_fp8": "modelopt", "nvfp4": "modelopt_fp4", "bnb": "bitsandbytes",
           "mxfp8": "modelopt_mxfp8", "int8": "w8a8_int8"}


def get_scheme(name: str) -> QuantScheme:
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in SCHEMES:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(SCHEMES)}")
    return SCHEMES[key]


def scheme_from_config(quant_config: dict | None) -> str | None:
    """The scheme of an HF ``quantization_config`` (None for a dense checkpoint)."""
    if not quant_config:
        return None
    method = str(quant_config.get("quant_method", "")).lower()
    if method == "fp8" and quant_config.get("weight_block_size"):
        return "fp8_block"
    if method == "modelopt":
        algo = str(quant_config.get("quant_algo", "fp8")).lower()
        return {"nvfp4": "modelopt_fp4", "mxfp8": "modelopt_mxfp8"}.get(algo, "modelopt")
    if not method:
        return None
    try:
        return get_scheme(method).name
    except ValueError:
        return method     # unknown here: explain reports it as not loadable
