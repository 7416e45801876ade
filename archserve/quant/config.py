"""Read a checkpoint's ``quantization_config`` into what each linear layer holds.

One ``LayerQuant`` says how one layer's weights are stored in the checkpoint (which
tensors, how packed) and what the kernels must compute (weight format, activation
quantization). ``QuantConfig.layer(name)`` answers for a module name, applying the
format's ignore list and targets. Everything here reads config.json only: a
checkpoint this build cannot load is refused before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from archserve.kernels.linear import formats as fmt
from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
)
from archserve.quant.schemes import find_scheme, loadable_methods

# Checkpoint layouts: which tensors a quantized layer stores (archserve.quant.layouts).
CT_FLOAT = "compressed-tensors float-quantized"     # fp8 weight + weight_scale (+ input_scale)
CT_INT = "compressed-tensors int-quantized"         # int8 weight + weight_scale (+ zero point)
CT_PACKED = "compressed-tensors pack-quantized"     # weight_packed int32 + scales (+ zeros)
GPTQ = "gptq"                                       # qweight/qzeros/scales/g_idx
AWQ = "awq"                                         # qweight/qzeros/scales, AWQ nibble order
HF_FP8 = "fp8"                                      # fp8 weight + weight_scale(_inv)
ONLINE_FP8 = "online fp8"                           # a dense weight, quantized after load
GGUF = "gguf"                                       # GGUF blocks, split into integer groups
MXFP4 = "mxfp4"                                     # OpenAI's blocks (e2m1) + scales (e8m0)


ACTIVATION_TEXT = {ACT_NONE: "16-bit activations",
                   ACT_DYNAMIC_TOKEN: "dynamic per-token activations",
                   ACT_DYNAMIC_GROUP: "dynamic per-group activations",
                   ACT_STATIC_TENSOR: "static per-tensor activations"}


@dataclass(frozen=True)
class LayerQuant:
    layout: str                      # one of the checkpoint layouts above
    weight_format: str               # the kernel vocabulary (formats.FP8, FP8_BLOCK, INT8, WNA16)
    bits: int
    strategy: str                    # weights: "tensor" | "channel" | "group" | "block"
    activation: str = ACT_NONE       # quantized_weights.ACT_*
    group_size: int | None = None    # "group" strategy
    block: tuple[int, int] | None = None   # "block" strategy: (rows, cols)
    symmetric: bool = True
    act_order: bool = False          # GPTQ desc_act: g_idx permutes the input channels
    zero_point_offset: int = 0       # GPTQ v1 stores zero - 1

    def describe(self) -> str:
        if self.layout == GGUF:
            return "GGUF blocks as int4/int8 groups (scale and offset), 16-bit activations"
        if self.layout == MXFP4:
            return "mxfp4 weights (e2m1, an e8m0 scale per 32), 16-bit activations"
        weights = {"tensor": "per-tensor", "channel": "per-channel",
                   "group": f"group {self.group_size}",
                   "block": f"{self.block[0]}x{self.block[1]} blocks" if self.block else ""
                   }[self.strategy]
        kind = "fp8" if self.weight_format in (fmt.FP8, fmt.FP8_BLOCK) else f"int{self.bits}"
        sym = "" if self.symmetric else " asymmetric"
        return f"{kind}{sym} weights ({weights}), {ACTIVATION_TEXT[self.activation]}"


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization is one this build cannot load (said before any weight)."""


@dataclass
class _Group:
    targets: list[str]
    layer: LayerQuant
    experts_only: bool = False       # the group quantizes routed experts, no linear layer


@dataclass
class QuantConfig:
    method: str                      # archserve.quant.schemes name
    groups: list[_Group]
    ignore: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def layer(self, module_name: str) -> LayerQuant | None:
        """The layer's quantization, or None when it stays unquantized (ignored, lm_head).
        An ignored name also covers every module under it ("model.layers.0": the whole
        first layer), as transformers reads HF fp8's modules_to_not_convert."""
        if _matches_any(module_name, self.ignore) or any(
                module_name.startswith(p + ".") for p in self.ignore if not p.startswith("re:")):
            return None
        for group in self.groups:
            if _matches_any(module_name, group.targets, linear_default=True):
                return group.layer
        return None

    @property
    def layers(self) -> list[LayerQuant]:
        """The quantizations of the checkpoint's linear layers (not of experts-only groups:
        MXFP4's routed experts, whose dense layers stay 16-bit)."""
        return [g.layer for g in self.groups if not g.experts_only]

    def describe(self) -> str:
        kinds = sorted({g.layer.describe() for g in self.groups})
        return f"{self.method}: " + "; ".join(kinds)


def _matches_any(name: str, patterns: Iterable[str], linear_default: bool = False) -> bool:
    # compressed-tensors targets: "Linear" (every linear layer), "re:<regex>" or a name
    # suffix; "lm_head" is never quantized by archserve (it is not a Linear module here).
    for pattern in patterns:
        if pattern == "Linear" and linear_default:
            return True
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


# ---- the parsers -------------------------------------------------------------------------

def parse_quant_config(config: dict[str, Any] | None) -> QuantConfig | None:
    """QuantConfig of an HF ``quantization_config`` dict (None when the checkpoint is dense).

    Raises UnsupportedQuantization naming what this build lacks.
    """
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower().replace("-", "_")
    parser = _PARSERS.get(method)
    if parser is None:
        raise UnsupportedQuantization(
            f"quantization method {config.get('quant_method')!r} is not loadable in this build "
            f"(loadable: {', '.join(loadable_methods())})")
    return parser(config)


# What users may pass as --quantization for a checkpoint of each method (vLLM's names).
_SAME_METHOD = {"gptq": {"gptq", "gptq_marlin"}, "awq": {"awq", "awq_marlin"},
                "compressed-tensors": {"compressed-tensors", "compressed_tensors"},
                "fp8": {"fp8"}, "fp8_block": {"fp8"}}


def resolve_quant_config(checkpoint_config: dict[str, Any] | None, requested: str | None,
                         is_gguf: bool = False, keep_gguf_quantized: bool = False
                         ) -> QuantConfig | None:
    """The quantization a model runs with: the checkpoint's, validated against
    ``--quantization``, or online fp8 for a 16-bit checkpoint. None: dense. A GGUF file is
    kept quantized where ``keep_gguf_quantized`` (GPUs), else dequantized at load."""
    requested = requested.strip().lower() if requested else None
    if is_gguf:
        if requested not in (None, "gguf"):
            raise UnsupportedQuantization(f"--quantization {requested}: this is a GGUF file")
        return gguf_quant_config() if keep_gguf_quantized else None
    parsed = parse_quant_config(checkpoint_config)
    if requested is None:
        return parsed
    if parsed is None:
        return online_quant_config(requested)
    if requested.replace("_", "-") not in {m.replace("_", "-")
                                           for m in _SAME_METHOD.get(parsed.method, set())}:
        raise UnsupportedQuantization(
            f"--quantization {requested} does not match the checkpoint, which is "
            f"{parsed.method}-quantized (leave --quantization out to use it)")
    return parsed


def explain_quant_config(checkpoint_config: dict[str, Any] | None, requested: str | None,
                         is_gguf: bool = False, keep_gguf_quantized: bool = False
                         ) -> QuantConfig | None:
    """What ``explain --quantization`` routes: the checkpoint's own config, or, for a
    scheme asked of a checkpoint that does not carry it, that scheme's common form
    (``QuantScheme.checkpoint``: AWQ and GPTQ 4-bit group 128, fp8 block 128x128, INT8 W8A8
    per channel ...)."""
    try:
        return resolve_quant_config(checkpoint_config, requested, is_gguf, keep_gguf_quantized)
    except UnsupportedQuantization:
        # A checkpoint of the requested method that this build refuses stays refused: its
        # own config, not the method's common form, is what would run.
        if not requested or _same_method(checkpoint_config, requested):
            raise
    scheme = find_scheme(requested)
    if scheme is not None and scheme.name == "gguf":
        return gguf_quant_config() if keep_gguf_quantized else None
    if scheme is not None and scheme.checkpoint is not None:
        return parse_quant_config(scheme.checkpoint)
    return parse_quant_config({"quant_method": requested})   # raises, naming what is loadable


def _same_method(checkpoint_config: dict[str, Any] | None, requested: str) -> bool:
    if not checkpoint_config:
        return False
    method = str(checkpoint_config.get("quant_method", "")).lower().replace("-", "_")
    names = {m.replace("-", "_") for m in _SAME_METHOD.get(method.replace("_", "-"), set())
             | _SAME_METHOD.get(method, set())} | {method}
    return requested.strip().lower().replace("-", "_") in names


def gguf_quant_config() -> QuantConfig:
    """A GGUF file kept quantized: each linear weight's blocks as integer groups (bits and
    group size per tensor, see archserve.quant.gguf_blocks); one weight-only kernel. The
    routed experts of an MoE are not: no MoE kernel reads GGUF blocks, so the loader
    dequantizes them (archserve.quant.plan.gguf_experts_decision says so)."""
    layer = LayerQuant(GGUF, fmt.WNA16, 0, "group")
    return QuantConfig("gguf", [_Group(["Linear"], layer)], ignore=[r"re:.*\.experts\."],
                       raw={"quant_method": "gguf"})


def online_quant_config(method: str) -> QuantConfig:
    """``--quantization fp8`` on a 16-bit checkpoint: per-channel fp8 weights made at load,
    dynamic per-token fp8 activations (as vLLM's online fp8)."""
    if method != "fp8":
        raise UnsupportedQuantization(
            f"--quantization {method} on an unquantized checkpoint: only fp8 can be made "
            "at load (online); other schemes need a quantized checkpoint")
    layer = LayerQuant(ONLINE_FP8, fmt.FP8, 8, "channel", ACT_DYNAMIC_TOKEN)
    return QuantConfig("fp8", [_Group(["Linear"], layer)], raw={"quant_method": "fp8"})


def _compressed_tensors(config: dict[str, Any]) -> QuantConfig:
    groups = []
    checkpoint_format = config.get("format")
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights")
        if not weights:
            raise UnsupportedQuantization(f"compressed-tensors group {name} quantizes no weights")
        layer = _ct_layer(weights, group.get("input_activations"),
                          group.get("format") or checkpoint_format, name)
        groups.append(_Group(list(group.get("targets") or ["Linear"]), layer))
    if not groups:
        raise UnsupportedQuantization("compressed-tensors config has no config_groups")
    if config.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (quantized KV "
                                      "scales in the checkpoint) is not loadable in this build")
    return QuantConfig("compressed-tensors", groups, list(config.get("ignore") or []), config)


def _ct_layer(weights: dict[str, Any], acts: dict[str, Any] | None, checkpoint_format: str | None,
              group_name: str) -> LayerQuant:
    wtype, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    strategy = weights.get("strategy", "tensor")
    symmetric = bool(weights.get("symmetric", True))
    activation = _ct_activation(acts, group_name)
    where = f"compressed-tensors group {group_name}"
    if weights.get("dynamic"):
        raise UnsupportedQuantization(f"{where}: dynamic weight quantization is not loadable")
    if wtype == "float":
        if bits != 8:
            raise UnsupportedQuantization(f"{where}: float{bits} weights are not loadable "
                                          "(fp8 only; nvfp4 needs an FP4 kernel)")
        if strategy == "block":
            block = tuple(weights.get("block_structure") or (128, 128))
            if activation not in (ACT_DYNAMIC_GROUP, ACT_DYNAMIC_TOKEN, ACT_NONE):
                raise UnsupportedQuantization(f"{where}: block fp8 with {activation} activations")
            activation = ACT_DYNAMIC_GROUP if activation != ACT_NONE else ACT_NONE
            return LayerQuant(CT_FLOAT, fmt.FP8_BLOCK, 8, "block", activation, block=block)
        if strategy not in ("tensor", "channel"):
            raise UnsupportedQuantization(f"{where}: fp8 {strategy} weight scales")
        if not symmetric:
            raise UnsupportedQuantization(f"{where}: asymmetric fp8 weights")
        return LayerQuant(CT_FLOAT, fmt.FP8, 8, strategy, activation)
    if wtype != "int":
        raise UnsupportedQuantization(f"{where}: weight type {wtype!r}")
    if activation != ACT_NONE:
        if bits != 8 or strategy not in ("channel", "tensor") or not symmetric:
            raise UnsupportedQuantization(
                f"{where}: int{bits} {strategy} weights with quantized activations (W{bits}A8); "
                "loadable: INT8 W8A8 with symmetric per-channel or per-tensor weights")
        if activation == ACT_DYNAMIC_GROUP:
            raise UnsupportedQuantization(f"{where}: int8 per-group activations")
        return LayerQuant(CT_INT, fmt.INT8, 8, strategy, activation)
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"{where}: int{bits} weights (4 and 8 are loadable)")
    if strategy not in ("group", "channel"):
        raise UnsupportedQuantization(f"{where}: int{bits} weight-only with {strategy} scales")
    group_size = int(weights["group_size"]) if strategy == "group" else None
    if weights.get("actorder") not in (None, False, "weight", "static"):
        # "group" act order stores a g_idx permutation; "weight" order needs none at load.
        raise UnsupportedQuantization(f"{where}: actorder {weights.get('actorder')!r}")
    layout = CT_PACKED if checkpoint_format in (None, "pack-quantized") else CT_INT
    if checkpoint_format not in (None, "pack-quantized", "naive-quantized", "int-quantized"):
        raise UnsupportedQuantization(f"{where}: format {checkpoint_format!r}")
    return LayerQuant(layout, fmt.WNA16, bits, strategy, ACT_NONE, group_size=group_size,
                      symmetric=symmetric)


def _ct_activation(acts: dict[str, Any] | None, group_name: str) -> str:
    if not acts:
        return ACT_NONE
    where = f"compressed-tensors group {group_name}"
    if acts.get("type", "int") == "float" and int(acts.get("num_bits", 8)) != 8:
        raise UnsupportedQuantization(f"{where}: float{acts.get('num_bits')} activations")
    if not acts.get("symmetric", True):
        raise UnsupportedQuantization(f"{where}: asymmetric activations (zero points)")
    strategy = acts.get("strategy", "tensor")
    dynamic = acts.get("dynamic")
    if strategy == "token" and dynamic:
        return ACT_DYNAMIC_TOKEN
    if strategy == "group" and dynamic:
        return ACT_DYNAMIC_GROUP
    if strategy == "tensor" and not dynamic:
        return ACT_STATIC_TENSOR
    if strategy == "tensor" and dynamic:
        return ACT_DYNAMIC_TOKEN   # a per-token scale is at least as fine as per-tensor
    raise UnsupportedQuantization(f"{where}: {'dynamic' if dynamic else 'static'} "
                                  f"{strategy} activations")


def _hf_fp8(config: dict[str, Any]) -> QuantConfig:
    block = config.get("weight_block_size")
    dynamic = config.get("activation_scheme", "dynamic") == "dynamic"
    if block:
        if not dynamic:
            raise UnsupportedQuantization("fp8 with weight_block_size and static activations")
        layer = LayerQuant(HF_FP8, fmt.FP8_BLOCK, 8, "block", ACT_DYNAMIC_GROUP,
                           block=(int(block[0]), int(block[1])))
    else:
        layer = LayerQuant(HF_FP8, fmt.FP8, 8, "tensor",
                           ACT_DYNAMIC_TOKEN if dynamic else ACT_STATIC_TENSOR)
    ignore = list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])
    groups = [_Group(["Linear"], layer)]
    if str(config.get("expert_dtype", "fp8")).lower() == "fp4":
        # DeepSeek V4's release (transformers folds its top-level expert_dtype in here): the
        # routed experts as e2m1 pairs a byte with a ue8m0 scale per 32 input channels,
        # MXFP4's encoding (models/deepseek_v4.py names them so); the rest fp8 as above.
        groups.insert(0, _Group([EXPERT_MATRICES], MXFP4_EXPERTS, experts_only=True))
    return QuantConfig("fp8_block" if block else "fp8", groups, ignore, config)


def _gptq(config: dict[str, Any]) -> QuantConfig:
    bits = int(config.get("bits", 4))
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"GPTQ {bits}-bit (4 and 8 are loadable)")
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format {checkpoint_format!r}")
    group = int(config.get("group_size", 128))
    layer = LayerQuant(GPTQ, fmt.WNA16, bits, "group" if group > 0 else "channel",
                       group_size=group if group > 0 else None,
                       symmetric=bool(config.get("sym", True)),
                       act_order=bool(config.get("desc_act", False)),
                       zero_point_offset=1 if checkpoint_format == "gptq" else 0)
    return QuantConfig("gptq", [_Group(["Linear"], layer)],
                       list(config.get("modules_to_not_convert") or []), config)


def _awq(config: dict[str, Any]) -> QuantConfig:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise UnsupportedQuantization(f"AWQ {bits}-bit {version} (loadable: 4-bit GEMM layout)")
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    layer = LayerQuant(AWQ, fmt.WNA16, 4, "group", group_size=group,
                       symmetric=not bool(config.get("zero_point", True)))
    return QuantConfig("awq", [_Group(["Linear"], layer)],
                       list(config.get("modules_to_not_convert") or []), config)


# The expert matrices' module names (models/layers/moe.py: ``<moe>.experts.<e>.<proj>``).
EXPERT_MATRICES = r"re:.*\.experts\.\d+\."


def _glob_pattern(pattern: str) -> str:
    """A ``modules_to_not_convert`` entry with ``*`` wildcards (OpenAI's
    ``model.layers.*.self_attn``) as a ``re:`` pattern matching the module and what is
    under it; plain names stay names."""
    if "*" not in pattern:
        return pattern
    body = r"[^.]+".join(re.escape(part) for part in pattern.split("*"))
    return f"re:{body}(\\.|$)"


MXFP4_EXPERTS = LayerQuant(MXFP4, fmt.MXFP4, 4, "group", ACT_NONE, group_size=32)


def _mxfp4(config: dict[str, Any]) -> QuantConfig:
    """OpenAI's MXFP4 (gpt-oss; transformers' and vLLM's ``mxfp4`` method): the routed
    experts' matrices as ``*_blocks`` (e2m1) and ``*_scales`` (e8m0, one per 32 input
    channels); every other layer stays 16-bit, as both read it."""
    ignore = [_glob_pattern(p) for p in config.get("modules_to_not_convert") or []]
    return QuantConfig("mxfp4", [_Group([EXPERT_MATRICES], MXFP4_EXPERTS, experts_only=True)],
                       ignore, config)


_PARSERS = {
    "compressed_tensors": _compressed_tensors,
    "fp8": _hf_fp8,
    "gptq": _gptq,
    "awq": _awq,
    "mxfp4": _mxfp4,
}
