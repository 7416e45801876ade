"""How a quantized checkpoint runs on a device: the kernel per kind of quantized layer, and
the decision said aloud.

Seed 000 §5.2's dual path, made real: the scheme's native kernel where the silicon and
this build have it (FP8 W8A8 through ``torch._scaled_mm`` on SM89+), else the Triton
weight-only kernel (FP8 and integer weights dequantized in registers, from SM70), else
the weight dequantized once at start-up (TORCH_DEQUANT: CPUs; it still quantizes a W8A8
checkpoint's activations). Rules-only backends (the
CUTLASS and Marlin kernels of vLLM) can be the *ideal*, never the route. The engine
installs exactly the selections made here, so ``explain`` and start-up tell one story.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from archserve.kernels.catalog import default_registry
from archserve.kernels.linear import formats as fmt
from archserve.kernels.linear.quantized_weights import ACT_DYNAMIC_TOKEN, ACT_NONE
from archserve.kernels.registry import BackendError, LibraryAssumption, Selection
from archserve.kernels.specs import LinearSpec
from archserve.platform.decision import Decision
from archserve.platform.device import DeviceInfo
from archserve.quant.config import (
    ACTIVATION_TEXT,
    AWQ,
    CT_FLOAT,
    CT_INT,
    CT_PACKED,
    GPTQ,
    HF_FP8,
    MXFP4,
    ONLINE_FP8,
    LayerQuant,
    QuantConfig,
)

# Backends that run a W8A8 checkpoint's weights without quantizing its activations.
WEIGHT_ONLY_BACKENDS = ("TRITON_WEIGHT_ONLY", "MARLIN")


@dataclass
class LayerPlan:
    """One kind of quantized linear layer and the backend that runs it here."""

    quant: LayerQuant
    spec: LinearSpec
    selection: Selection | None
    error: str | None = None


@dataclass
class QuantPlan:
    config: QuantConfig | None
    layers: list[LayerPlan] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    refused: str | None = None      # the scheme itself is not loadable (no layers planned)

    @property
    def moe_format(self) -> str | None:
        quant = expert_quant(self.config)
        return quant.weight_format if quant else None

    @property
    def moe_activation(self) -> str:
        quant = expert_quant(self.config)
        return quant.activation if quant else ACT_DYNAMIC_TOKEN

    @property
    def not_loadable(self) -> str | None:
        errors = [self.refused] + [p.error for p in self.layers]
        return "; ".join(e for e in errors if e) or None


def layer_spec(quant: LayerQuant, dtype: torch.dtype) -> LinearSpec:
    group = (quant.group_size if quant.strategy == "group" else -1
             if quant.weight_format == fmt.WNA16 else None)
    return LinearSpec(dtype=dtype, quant_scheme=quant.weight_format, activation=quant.activation,
                      group_size=group)


def keeps_gguf_quantized(device: DeviceInfo, dtype: torch.dtype) -> bool:
    """Whether a GGUF file's linear layers stay packed on ``device`` at ``dtype`` (else they
    are expanded to dense weights at load): on GPUs, where a Triton kernel dequantizes in
    registers, and on CPUs where CPU_WEIGHT_ONLY runs (its ISA, a bfloat16 model)."""
    if device.is_gpu:
        return True
    backend = default_registry().get("linear", "CPU_WEIGHT_ONLY")
    return backend.hardware_rule(device, LinearSpec(dtype=dtype,
                                                    quant_scheme=fmt.WNA16)) is None


def lm_head_spec(device: DeviceInfo, dtype: torch.dtype) -> LinearSpec:
    """What the LM head asks of the linear registry: on a CPU where CPU_WEIGHT_ONLY runs, an
    8-bit weight-only copy is a candidate (its start-up timing keeps it for the row counts
    it is faster at: kernels/linear/cpu_lm_head.py); elsewhere the dense GEMM of the model's
    dtype (unquantized, as in vLLM by default)."""
    if device.platform == "cpu" and keeps_gguf_quantized(device, dtype):
        return LinearSpec(dtype=dtype, quant_scheme=fmt.WNA16, group_size=-1)
    return LinearSpec(dtype=dtype)


def lm_head_decision(spec: LinearSpec, backend: str, chosen: str | None = None
                     ) -> Decision | None:
    """Why the LM head's route (``lm_head_spec``) is ``backend``, where it has a
    lower-precision candidate; None for the dense head. ``chosen``: what start-up timing
    chose (the engine's decision); without it, the candidates (explain, doctor)."""
    if spec.quant_scheme is None:
        return None
    if chosen is None:
        from archserve.kernels.linear.cpu_lm_head import LM_HEAD_CANDIDATES
        chosen = LM_HEAD_CANDIDATES
    return Decision("LM head", f"dense {str(spec.dtype).removeprefix('torch.')}", backend,
                    chosen)


def plan_quantization(device: DeviceInfo, config: QuantConfig | None, dtype: torch.dtype,
                      libraries: LibraryAssumption = "installed") -> QuantPlan:
    """The backend of every kind of quantized layer in ``config``, with the decision."""
    plan = QuantPlan(config)
    if config is None:
        return plan
    registry = default_registry()
    for quant in dict.fromkeys(config.layers):          # distinct, in config order
        spec = layer_spec(quant, dtype)
        try:
            selection = registry.select("linear", device, spec, libraries=libraries)
        except BackendError as exc:
            plan.layers.append(LayerPlan(quant, spec, None, f"{quant.describe()}: {exc}"))
            continue
        plan.layers.append(LayerPlan(quant, spec, selection))
        plan.decisions.append(Decision("quantization", f"{config.method} {quant.describe()}",
                                       selection.name, _reason(device, quant, spec, selection,
                                                               dtype, libraries)))
    return plan


def _reason(device: DeviceInfo, quant: LayerQuant, spec: LinearSpec, selection: Selection,
            dtype: torch.dtype, libraries: LibraryAssumption) -> str:
    registry = default_registry()
    chosen = selection.backend
    parts = []
    if selection.ideal and selection.ideal != chosen.name:
        ideal = registry.get("linear", selection.ideal)
        why = ideal.availability(device, libraries) or "it lost to a runtime check"
        parts.append(f"ideal {ideal.name} is not used: {why}")
    parts.append(f"{chosen.name}: {chosen.description}")
    if quant.activation != ACT_NONE and chosen.name in WEIGHT_ONLY_BACKENDS:
        parts.append(f"the checkpoint's {ACTIVATION_TEXT[quant.activation]} are not "
                     f"quantized: they stay {str(dtype).removeprefix('torch.')}")
    return "; ".join(parts)


# The checkpoint names of one expert matrix in the two conventions (models/layers/moe.py).
_EXPERT_MATRICES = ("model.layers.0.mlp.experts.0.gate_proj",
                    "model.layers.0.block_sparse_moe.experts.0.w1")
# Checkpoint layouts whose experts load (quant/expert_state.py repacks them per expert).
_EXPERT_LAYOUTS = (CT_FLOAT, HF_FP8, CT_PACKED, CT_INT, GPTQ, AWQ, ONLINE_FP8, MXFP4)


def expert_quant(config: QuantConfig | None) -> LayerQuant | None:
    """How the checkpoint quantizes the routed experts (None: 16-bit or no MoE)."""
    if config is None:
        return None
    return next((q for q in map(config.layer, _EXPERT_MATRICES) if q is not None), None)


def quantized_experts_refusal(config: QuantConfig | None, has_moe: bool) -> str | None:
    """Why a checkpoint whose routed experts are quantized cannot load here (None if it can).

    Loadable: FP8 (per-tensor, per-channel, 128x128 blocks; compressed-tensors or HF
    ``fp8``), integer groups without act order (GPTQ, AWQ, compressed-tensors W4A16 /
    W8A16), MXFP4 (OpenAI's ``mxfp4``), online fp8 (``--quantization fp8``) of a 16-bit
    MoE, and GGUF (its experts are dequantized at load: see gguf_experts_decision)."""
    quant = expert_quant(config) if has_moe else None
    if quant is None:
        return None
    what = f"the routed experts are quantized ({quant.describe()})"
    if quant.layout not in _EXPERT_LAYOUTS or quant.weight_format not in (
            fmt.FP8, fmt.FP8_BLOCK, fmt.WNA16, fmt.MXFP4):
        return (f"{what}; this build's MoE kernels run fp8 (per-tensor, per-channel, "
                f"128x128 blocks), W4A16/W8A16 integer-group and MXFP4 experts, not "
                f"{quant.weight_format} (`explain --op moe --quantization ...` shows vLLM's "
                f"choice)")
    if quant.act_order:
        return (f"{what} with GPTQ act order (desc_act): each expert would read its input "
                f"channels in its own order, which the MoE kernels do not")
    if quant.block is not None and quant.block != (128, 128):
        return f"{what}; the MoE kernels take 128x128 fp8 blocks only"
    return None


def gguf_experts_decision(is_gguf: bool, has_moe: bool, dtype: torch.dtype) -> Decision | None:
    """What becomes of a GGUF MoE's routed experts: dequantized at load, whatever their
    block type, because no MoE kernel here reads GGUF blocks (a GPU still keeps the
    attention and shared-expert linears quantized)."""
    if not (is_gguf and has_moe):
        return None
    name = str(dtype).removeprefix("torch.")
    return Decision("quantization", "gguf experts", f"dense {name}",
                    f"no MoE kernel reads GGUF blocks: the routed experts are dequantized to "
                    f"{name} at load and run on the 16-bit MoE route")
