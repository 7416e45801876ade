"""Degradation rules: how a quantized checkpoint runs on this device, and the decision said aloud.

Seed 000 §5.2's dual path, generalised: the scheme's native kernel where the silicon
has it (FP8 on SM89+ -> CUTLASS_FP8), else the weight-only Marlin path (SM75-88),
else - where vLLM refuses - weights dequantized to the model dtype at load
(TORCH_DEQUANT), recorded as a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import LibraryAssumption, Selection
from archserve.kernels.specs import LinearSpec
from archserve.platform.device import DeviceInfo
from archserve.quant.schemes import QuantScheme, get_scheme
from archserve.routing.decision import Decision

WEIGHT_ONLY_BACKENDS = ("MARLIN",)


@dataclass
class QuantPlan:
    scheme: QuantScheme | None
    linear_spec: LinearSpec            # what the linear layers ask the selector for
    moe_format: str | None             # what the expert layers ask for
    decisions: list[Decision] = field(default_factory=list)


def linear_path(device: DeviceInfo, scheme: QuantScheme, dtype: torch.dtype = torch.float16
                ) -> str:
    """The ideal linear backend for the scheme here, by hardware rules alone."""
    if scheme.dequantized_at_load or scheme.weight_format is None:
        return "TORCH_MATMUL"
    spec = LinearSpec(dtype=dtype, quant_scheme=scheme.weight_format)
    return default_registry().select("linear", device, spec, libraries="all").ideal or ""


def fp8_path(device: DeviceInfo) -> str:
    """Seed 000 §5.2: "native" (SM89+), "marlin" (SM75-88, weight-only) or "dequant"."""
    ideal = linear_path(device, get_scheme("fp8"))
    return {"CUTLASS_FP8": "native", "MARLIN": "marlin"}.get(ideal, "dequant")


def plan_quantization(device: DeviceInfo, method: str | None, dtype: torch.dtype
                      ) -> QuantPlan:
    """Which weight format the layers run and every degradation on the way."""
    if method is None:
        return QuantPlan(None, LinearSpec(dtype=dtype), None)
    scheme = get_scheme(method)
    dtype_text = str(dtype).removeprefix("torch.")
    if scheme.dequantized_at_load:
        why = (f"archserve's {scheme.display} loader dequantizes every tensor to {dtype_text} "
               "at load, so its linear layers take the dense route of an unquantized model")
        return QuantPlan(scheme, LinearSpec(dtype=dtype), None,
                         [Decision("quantization", scheme.name, f"dense {dtype_text}", why)])

    linear_spec = LinearSpec(dtype=dtype, quant_scheme=scheme.weight_format)
    decisions: list[Decision] = []
    unsupported = scheme.hardware_rule(device)
    ideal = linear_path(device, scheme, dtype)
    if unsupported:
        decisions.append(Decision(
            "quantization", scheme.name, "TORCH_DEQUANT",
            f"{unsupported}; vLLM refuses, archserve dequantizes the weights to {dtype_text} "
            "at load (correct, but slower and without the memory saving)"))
    elif not scheme.native_backends:
        decisions.append(Decision(
            "quantization", scheme.name, "TORCH_DEQUANT",
            f"no {scheme.weight_format} GEMM kernel is registered; weights dequantized to "
            f"{dtype_text} at load"))
    elif ideal not in scheme.native_backends:
        native = default_registry().get("linear", scheme.native_backends[0])
        why = native.hardware_rule(device, linear_spec) or "unavailable"
        path = ("weight-only: weights dequantized inside the kernel, activations stay "
                f"{dtype_text}" if ideal in WEIGHT_ONLY_BACKENDS
                else f"weights dequantized to {dtype_text} at load")
        decisions.append(Decision("quantization", f"{scheme.name} ({native.name})", ideal,
                                  f"{native.name} {why}; {path}"))
    else:
        decisions.append(Decision("quantization", scheme.name, ideal or "TORCH_DEQUANT",
                                  f"{scheme.display} runs its native kernel here"))
    return QuantPlan(scheme, linear_spec, scheme.moe_format, decisions)


def select_quantized_linear(device: DeviceInfo, plan: QuantPlan,
                            libraries: LibraryAssumption = "installed",
                            override: str | None = None) -> Selection:
    """The linear backend for a plan (thin: the registry does the choosing)."""
    return default_registry().select("linear", device, plan.linear_spec, libraries=libraries,
                                     override=override)
