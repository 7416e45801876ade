"""Quantization schemes (seed 000 §5.1): what each needs and which kernels can execute it.

This table is the one truth about schemes: ``matrix`` draws a row from each entry,
``explain --quantization`` routes each entry's ``checkpoint`` form, and the loader's list of
loadable methods is read from it. Adding a scheme is adding an entry (and, for a new
checkpoint method, its parser in archserve.quant.config).

``min_capability`` is today's vLLM ``get_min_capability()`` (docs/deviations.md lists
where the seed differs): the least SM where vLLM has a kernel path. What archserve runs
is decided per layer by archserve.quant.plan from the kernels this build has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from archserve.kernels.linear import formats as fmt
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
    # How the scheme's linear and expert kernels quantize activations (quantized_weights'
    # ACT_* names): with the formats, the request vLLM's kernel lists are asked.
    activation: str = "none"
    moe_activation: str = "dynamic_token"
    in_vllm: bool = True                   # vLLM 0.33 registers the method
    # A load-time check vLLM makes above get_min_capability (GPTQ's verify_marlin_supported).
    vllm_floor: Capability | None = None
    # The ``quantization_config`` of the scheme's checkpoints in their common form, as this
    # build's loader reads it: what ``explain --quantization NAME`` and ``matrix`` route (a
    # GGUF file is read from its blocks, not a config). None: this build does not load the
    # scheme, and only vLLM's rule is shown for it.
    checkpoint: dict[str, Any] | None = None

    @property
    def loadable(self) -> bool:
        """Whether archserve's loader reads checkpoints of this scheme."""
        return self.checkpoint is not None

    def vllm_refusal(self, device: DeviceInfo) -> str | None:
        """Why vLLM 0.33 refuses this scheme on the device (None: it has a kernel path)."""
        if not self.in_vllm:
            return f"it registers no {self.name} quantization method"
        floor = self.vllm_floor
        if floor is not None and device.is_cuda and not device.has_capability(floor):
            return (f"{self.display} needs {floor}+ for its kernels (a check at load), "
                    f"device is {device_text(device)}")
        return self.hardware_rule(device)

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


# The common checkpoint forms (``QuantScheme.checkpoint``).
_GPTQ_4BIT = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
_AWQ_4BIT = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
_CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                 "symmetric": True}}}}
_CT_INT8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                      "dynamic": True, "symmetric": True}}}}


SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("gguf", "GGUF", _cap(60), None, None, (),
                "k-quant / legacy ggml blocks", dequantized_at_load=True, in_vllm=False,
                checkpoint={"quant_method": "gguf"}),
    QuantScheme("compressed-tensors", "compressed-tensors", _cap(70), None, None, (),
                "per-group config: fp8/int8 W8A8, fp8 block, packed int4/int8 W4A16/W8A16",
                checkpoint=_CT_W4A16),
    QuantScheme("gptq", "GPTQ", _cap(60), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4/int8 weights, group scales, fp16 activations", vllm_floor=_cap(75),
                checkpoint=_GPTQ_4BIT),
    QuantScheme("bitsandbytes", "BitsAndBytes", _cap(70), fmt.BNB, None, (),
                "NF4 / int8 weights", in_vllm=False),
    QuantScheme("awq", "AWQ", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4 weights, group scales and zeros", checkpoint=_AWQ_4BIT),
    QuantScheme("awq_marlin", "AWQ-Marlin", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4 weights repacked for Marlin", checkpoint=_AWQ_4BIT),
    QuantScheme("gptq_marlin", "GPTQ-Marlin", _cap(75), fmt.WNA16, fmt.WNA16, ("MARLIN",),
                "int4/int8 weights repacked for Marlin", checkpoint=_GPTQ_4BIT),
    # FP8's minimum is Turing because SM75-88 run it weight-only through Marlin (§5.2).
    QuantScheme("fp8", "FP8", _cap(75), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 e4m3 weights (+ dynamic fp8 activations), per-tensor/channel scales",
                activation="dynamic_token",
                checkpoint={"quant_method": "fp8", "activation_scheme": "dynamic"}),
    QuantScheme("fp8_block", "FP8 block-wise", _cap(75), fmt.FP8_BLOCK, fmt.FP8_BLOCK,
                ("CUTLASS_BLOCK_FP8",), "fp8 e4m3 weights with 128x128 block scales",
                activation="dynamic_group", moe_activation="dynamic_group",
                checkpoint={"quant_method": "fp8", "weight_block_size": [128, 128]}),
    QuantScheme("fbgemm_fp8", "FBGEMM FP8", _cap(80), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 weights, per-channel scales", activation="dynamic_token"),
    # ModelOpt FP8 and MXFP8 reach SM80 weight-only through Marlin (vLLM 0.33's
    # ModelOptFp8Config / ModelOptMxFp8Config.get_min_capability); natively 89+ / SM100.
    QuantScheme("modelopt", "ModelOpt FP8", _cap(80), fmt.FP8, fmt.FP8, ("CUTLASS_FP8",),
                "fp8 weights and activations, static scales", activation="static_tensor",
                moe_activation="static_tensor"),
    QuantScheme("modelopt_fp4", "ModelOpt NVFP4", _cap(75), fmt.NVFP4, fmt.NVFP4,
                ("CUTLASS_NVFP4",),
                "nvfp4 e2m1 weights, fp8 block scales (Marlin weight-only below SM100)",
                activation="dynamic_group"),
    QuantScheme("modelopt_mxfp8", "ModelOpt MXFP8", _cap(80), fmt.MXFP8, fmt.MXFP8, (),
                "mxfp8 weights, e8m0 block scales (Marlin weight-only below SM100)",
                activation="dynamic_group"),
    # OpenAI's MXFP4 (gpt-oss): the routed experts only; transformers and vLLM 0.33 keep
    # every linear layer 16-bit (vLLM's Mxfp4Config gives linears UnquantizedLinearMethod).
    QuantScheme("mxfp4", "MXFP4", _cap(80), None, fmt.MXFP4, (),
                "mxfp4 e2m1 expert weights, an e8m0 scale per 32 (dense layers 16-bit)",
                moe_activation="none", checkpoint={"quant_method": "mxfp4"}),
    QuantScheme("experts_int8", "Experts INT8", _cap(80), None, fmt.INT8, (),
                "int8 expert weights only (dense layers stay 16-bit)"),
    QuantScheme("w8a8_int8", "W8A8 INT8", _cap(75), fmt.INT8, fmt.INT8, ("CUTLASS_INT8",),
                "int8 weights and activations", activation="dynamic_token",
                checkpoint=_CT_INT8),
    QuantScheme("w4a8", "W4A8", _cap(90), fmt.W4A8, None, ("CUTLASS_W4A8",),
                "int4 weights, fp8 activations", activation="dynamic_token"),
    # The rest of vLLM 0.33's registered methods (model_executor/layers/quantization),
    # each by the kernel form its common checkpoints take; none loads in this build.
    QuantScheme("moe_wna16", "MoE WNA16", _cap(70), fmt.WNA16, fmt.WNA16, (),
                "GPTQ/AWQ integer groups with MoE-specific kernels"),
    QuantScheme("deepseek_v4_fp8", "DeepSeek V4 FP8", _cap(89), fmt.FP8_BLOCK, fmt.FP8_BLOCK,
                (), "DeepSeek V4's block fp8", activation="dynamic_group",
                moe_activation="dynamic_group"),
    QuantScheme("fp_quant", "FP-Quant", _cap(100), fmt.HADAMARD_FP4, None, ("QUTLASS",),
                "Hadamard-rotated MXFP4/NVFP4 weights and activations (QuTLASS)"),
    QuantScheme("torchao", "torchao", _cap(75), fmt.TORCHAO, None, ("TORCHAO",),
                "torchao tensor subclasses"),
    QuantScheme("humming", "Humming", _cap(75), fmt.WNA16, fmt.WNA16, (),
                "low-bit integer weights, 16-bit activations"),
    QuantScheme("quark", "Quark", _cap(70), fmt.FP8, fmt.FP8, (),
                "AMD Quark; its common checkpoints are fp8 W8A8", activation="dynamic_token",
                vllm_floor=_cap(75)),
    QuantScheme("inc", "Intel Neural Compressor", _cap(60), fmt.WNA16, fmt.WNA16, (),
                "AutoRound integer groups (GPTQ/AWQ layout)"),
    QuantScheme("modelopt_mixed", "ModelOpt mixed", _cap(75), fmt.NVFP4, fmt.NVFP4, (),
                "per-layer NVFP4 and FP8 (NVFP4 shown)", activation="dynamic_group"),
    QuantScheme("fp8_per_tensor", "online FP8 per tensor", _cap(75), fmt.FP8, fmt.FP8, (),
                "16-bit weights quantized at load", activation="dynamic_token"),
    QuantScheme("fp8_per_channel", "online FP8 per channel", _cap(75), fmt.FP8, fmt.FP8, (),
                "16-bit weights quantized at load", activation="dynamic_token"),
    QuantScheme("fp8_per_block", "online FP8 per block", _cap(75), fmt.FP8_BLOCK,
                fmt.FP8_BLOCK, (), "16-bit weights quantized at load",
                activation="dynamic_group", moe_activation="dynamic_group"),
    QuantScheme("int8_per_channel_weight_only", "online INT8 weight-only", _cap(75),
                fmt.WNA16, fmt.WNA16, (), "16-bit weights quantized to int8 at load"),
    QuantScheme("nvfp4_per_token", "online NVFP4", _cap(75), fmt.NVFP4, fmt.NVFP4, (),
                "16-bit weights quantized to nvfp4 at load", activation="dynamic_group"),
)}

ALIASES = {"compressed_tensors": "compressed-tensors", "modelopt_fp8": "modelopt", "nvfp4": "modelopt_fp4", "bnb": "bitsandbytes",
           "mxfp8": "modelopt_mxfp8", "int8": "w8a8_int8", "auto_awq": "awq",
           "auto_gptq": "gptq", "gpt_oss_mxfp4": "mxfp4", "online": "fp8_per_channel"}


def find_scheme(name: str) -> QuantScheme | None:
    """The scheme a user's name means (vLLM's names and aliases), or None."""
    key = name.strip().lower().replace("-", "_")
    return SCHEMES.get(ALIASES.get(key, key))


def get_scheme(name: str) -> QuantScheme:
    found = find_scheme(name)
    if found is None:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(SCHEMES)}")
    return found


def loadable_methods() -> tuple[str, ...]:
    """The checkpoint ``quant_method``s this build's loader reads."""
    return tuple(sorted({s.checkpoint["quant_method"] for s in SCHEMES.values()
                         if s.checkpoint is not None}))


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


def compressed_tensors_form(config: dict | None) -> tuple[str | None, str] | None:
    """(weight format, activation quantization) of a compressed-tensors config's first group,
    as vLLM's kernels would see it: float4 weights are NVFP4 (groups of 16) or MXFP4, float8
    FP8 (block scales: FP8 block), int4 with 8-bit activations W4A8, int8 with them W8A8,
    integers alone W4A16/W8A16. None: no group to read."""
    groups = (config or {}).get("config_groups") or {}
    group = next(iter(groups.values()), None)
    if not group or not group.get("weights"):
        return None
    weights, acts = group["weights"], group.get("input_activations")
    bits, kind = int(weights.get("num_bits", 8)), weights.get("type", "int")
    if acts is None:
        activation = "none"
    elif acts.get("strategy") == "group" and acts.get("dynamic"):
        activation = "dynamic_group"
    elif acts.get("dynamic") is False:
        activation = "static_tensor"
    else:
        activation = "dynamic_token"
    if kind == "float" and bits == 4:
        return (fmt.NVFP4 if weights.get("group_size") == 16 else fmt.MXFP4), activation
    if kind == "float":
        return (fmt.FP8_BLOCK if weights.get("strategy") == "block" else fmt.FP8), activation
    if acts is not None:
        return (fmt.W4A8 if bits == 4 else fmt.INT8), activation
    return fmt.WNA16, "none"
