"""Explain: for a device (live or a profile) and a request or model, the route of every layer kind.

Each route names the backend this build runs under the library assumption, the
*ideal* backend by hardware rules alone, and why every earlier candidate lost. The
dict form is the JSON of ``archserve explain --json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import (
    OP_KINDS,
    BackendError,
    LibraryAssumption,
    Rejection,
    Selection,
    override_from_env,
)
from archserve.kernels.specs import AttentionSpec, LinearSpec, MoESpec
from archserve.models.registry import architecture_unsupported, op_kinds_of_supported_architectures
from archserve.platform.device import DeviceInfo
from archserve.quant.config import UnsupportedQuantization, explain_quant_config
from archserve.quant.plan import QuantPlan, plan_quantization
from archserve.routing.decision import Decision
from archserve.routing.dtypes import dtype_name, resolve_dtype, resolve_kv_cache_dtype
from archserve.routing.model_summary import ModelSummary

# DeepSeek-V3's MLA: 128 heads over a 512-dim latent plus 64 rope dims (head 576).
DEEPSEEK_V3_MLA = dict(head_size=576, num_heads=128, num_kv_heads=1, use_mla=True,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                       v_head_dim=128)


@dataclass
class Route:
    op: str
    layer: str
    backend: str
    ideal: str | None
    rejected: list[Rejection] = field(default_factory=list)
    detail: str = ""          # what the chosen backend runs here (e.g. "FA3")
    ideal_detail: str = ""
    forced: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "layer": self.layer, "backend": self.backend,
                "ideal": self.ideal,
                "rejected": [{"backend": r.backend, "reason": r.reason} for r in self.rejected],
                "detail": self.detail, "ideal_detail": self.ideal_detail,
                "forced": self.forced}


@dataclass
class Explanation:
    device: DeviceInfo
    dtype: torch.dtype
    decisions: list[Decision]
    routes: list[Route]
    libraries: str = "installed"
    not_loadable: str | None = None      # why this build cannot load the model, if it cannot

    def to_dict(self) -> dict[str, Any]:
        return {"device": device_dict(self.device), "dtype": dtype_name(self.dtype),
                "libraries": self.libraries, "not_loadable": self.not_loadable,
                "decisions": [d.to_dict() for d in self.decisions],
                "routes": [r.to_dict() for r in self.routes]}


def device_dict(device: DeviceInfo) -> dict[str, Any]:
    cap = device.capability
    return {"id": device.id, "name": device.name, "platform": device.platform,
            "capability": None if cap is None else [cap.major, cap.minor]}


def libraries_text(libraries: LibraryAssumption) -> str:
    if isinstance(libraries, frozenset):
        return ",".join(sorted(libraries))
    return libraries


def parse_libraries(text: str) -> LibraryAssumption:
    """``all`` | ``none`` | ``installed`` | a comma-separated list of library names."""
    key = text.strip().lower()
    if key in ("all", "none", "installed"):
        return key
    return frozenset(n.strip() for n in key.split(",") if n.strip())


def _detail(op: str, name: str | None, device: DeviceInfo, spec: Any) -> str:
    if name is None:
        return ""
    backend = default_registry().get(op, name)
    describe = getattr(backend, "detail", None)
    return describe(device, spec) if describe else ""


def route_from_selection(selection: Selection, layer: str, device: DeviceInfo, spec: Any
                         ) -> Route:
    return Route(op=selection.op, layer=layer, backend=selection.name, ideal=selection.ideal,
                 rejected=list(selection.rejected),
                 detail=_detail(selection.op, selection.name, device, spec),
                 ideal_detail=_detail(selection.op, selection.ideal, device, spec),
                 forced=selection.forced)


def explain_op(device: DeviceInfo, op: str, spec: Any,
               libraries: LibraryAssumption = "installed", layer: str | None = None,
               override: str | None = None) -> Route:
    """One op kind's route; an override (or ARCHSERVE_<OP>_BACKEND) is validated as in serving."""
    selection = default_registry().select(op, device, spec, libraries=libraries,
                                          override=override_from_env(op, override))
    return route_from_selection(selection, layer or op, device, spec)


def explain_op_request(device: DeviceInfo, op: str, head_size: int | None = None,
                       dtype: str = "auto", kv_cache_dtype: str = "auto",
                       block_size: int | None = None,
                       libraries: LibraryAssumption = "installed",
                       override: str | None = None, quantization: str | None = None
                       ) -> Explanation:
    """``explain --op OP``: one layer of any op kind the registry routes, dtype decisions
    first. Attention needs a head size (MLA assumes DeepSeek-V3's); linear and MoE take
    Llama-3-8B's and Mixtral-8x7B's shapes, quantized as ``quantization`` says."""
    if op not in OP_KINDS:
        raise ValueError(f"--op must be one of {', '.join(OP_KINDS)}, not {op!r}")
    torch_dtype, decisions = resolve_dtype(device, dtype)
    # As in doctor: an op no loadable architecture has gets its ideal, never a route.
    not_loadable = (None if op in op_kinds_of_supported_architectures()
                    else f"no supported architecture has {op} layers")
    if op in ("linear", "moe"):
        plan = _quantization_plan(device, None, quantization, False, torch_dtype, libraries)
        if plan.not_loadable:
            raise ValueError(plan.not_loadable)
        routes = (_linear_routes(device, plan, torch_dtype, libraries, not_loadable)
                  if op == "linear"
                  else [_moe_route(device, MoESpec(dtype=torch_dtype,
                                                   quant_scheme=plan.moe_format), libraries,
                                   not_loadable)])
        if override and not_loadable is None:
            routes = [explain_op(device, op, route_spec, libraries, layer=route.layer,
                                 override=override)
                      for route, route_spec in zip(routes, _specs_of(op, plan, torch_dtype),
                                                   strict=True)]
        return Explanation(device, torch_dtype, decisions + plan.decisions, routes,
                           libraries_text(libraries), not_loadable)
    kv, kv_decisions = resolve_kv_cache_dtype(device, kv_cache_dtype)
    shape: dict[str, Any] = dict(DEEPSEEK_V3_MLA) if op == "mla_attention" else {}
    if head_size is not None:
        shape["head_size"] = head_size
    elif op == "attention":
        raise ValueError("--op attention needs --head-size")
    spec = AttentionSpec(dtype=torch_dtype, kv_cache_dtype=kv, block_size=block_size, **shape)
    route = (explain_op(device, op, spec, libraries, override=override)
             if override and not_loadable is None
             else _route(device, op, spec, libraries, op, not_loadable))
    return Explanation(device, torch_dtype, decisions + kv_decisions, [route],
                       libraries_text(libraries), not_loadable)


def _specs_of(op: str, plan: QuantPlan, dtype: torch.dtype) -> list[Any]:
    """The spec behind each route ``explain_op_request`` lists for linear or MoE."""
    if op == "moe":
        return [MoESpec(dtype=dtype, quant_scheme=plan.moe_format)]
    return [layer.spec for layer in plan.layers] or [LinearSpec(dtype=dtype)]


def _quantization_plan(device: DeviceInfo, checkpoint_config: dict[str, Any] | None,
                       quantization: str | None, is_gguf: bool, dtype: torch.dtype,
                       libraries: LibraryAssumption) -> QuantPlan:
    """The plan of the checkpoint's (or the requested) quantization; an unloadable scheme
    gives an empty plan whose ``not_loadable`` says why."""
    try:
        quant = explain_quant_config(checkpoint_config, quantization, is_gguf,
                                     keep_gguf_quantized=device.is_gpu)
    except UnsupportedQuantization as exc:
        return QuantPlan(None, refused=str(exc))
    return plan_quantization(device, quant, dtype, libraries)


def _linear_routes(device: DeviceInfo, plan: QuantPlan, dtype: torch.dtype,
                   libraries: LibraryAssumption, not_loadable: str | None) -> list[Route]:
    """One route per quantized layer kind of the plan, or the dense linear route."""
    if not plan.layers:
        return [_route(device, "linear", LinearSpec(dtype=dtype), libraries,
                       "linear (qkv, o, mlp)", not_loadable)]
    return [_route(device, "linear", layer.spec, libraries,
                   "linear (qkv, o, mlp)" if len(plan.layers) == 1
                   else f"linear ({layer.quant.describe()})", not_loadable)
            for layer in plan.layers]


def _moe_route(device: DeviceInfo, spec: MoESpec, libraries: LibraryAssumption,
               not_loadable: str | None) -> Route:
    return _route(device, "moe", spec, libraries, "moe experts", not_loadable)


def explain_model(device: DeviceInfo, model: ModelSummary, dtype: str = "auto",
                  kv_cache_dtype: str = "auto", quantization: str | None = None,
                  libraries: LibraryAssumption = "installed") -> Explanation:
    """One route per layer kind of the model: attention (or MLA), linear, MoE, lm_head.

    A model this build cannot load (architecture or quantization) gets no route: the
    explanation says why in ``not_loadable`` and shows each layer's ideal backend only.
    """
    torch_dtype, decisions = resolve_dtype(device, dtype, model.dtype)
    kv, kv_decisions = resolve_kv_cache_dtype(device, kv_cache_dtype)
    decisions += kv_decisions
    not_loadable = architecture_unsupported(model.architecture)
    plan = _quantization_plan(device, model.quantization_config, quantization, model.is_gguf,
                              torch_dtype, libraries)
    not_loadable = "; ".join(filter(None, [not_loadable, plan.not_loadable])) or None
    if not_loadable is None:
        decisions += plan.decisions
    if model.is_gguf and plan.config is None and quantization in (None, "gguf"):
        decisions.append(Decision("quantization", "gguf", f"dense {dtype_name(torch_dtype)}",
                                  "archserve's GGUF loader dequantizes every tensor at load, so "
                                  "its linear layers take the dense route"))

    attention = AttentionSpec(
        head_size=model.head_size, dtype=torch_dtype, kv_cache_dtype=kv,
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
        sliding_window=model.sliding_window, logit_soft_cap=model.logit_soft_cap,
        use_mla=model.use_mla, mla_sparse=model.mla_sparse, kv_lora_rank=model.kv_lora_rank,
        qk_rope_head_dim=model.qk_rope_head_dim, qk_nope_head_dim=model.qk_nope_head_dim,
        v_head_dim=model.v_head_dim)
    op = "mla_attention" if model.use_mla else "attention"
    routes = [_route(device, op, attention, libraries, "attention", not_loadable)]
    routes += _linear_routes(device, plan, torch_dtype, libraries, not_loadable)
    if model.is_moe:
        moe = MoESpec(dtype=torch_dtype, quant_scheme=plan.moe_format,
                      num_experts=model.num_experts, top_k=model.experts_per_token or 2,
                      hidden_size=model.hidden_size,
                      intermediate_size=model.intermediate_size)
        routes.append(_moe_route(device, moe, libraries, not_loadable))
    # lm_head stays unquantized in every scheme archserve loads (as in vLLM by default).
    routes.append(_route(device, "linear", LinearSpec(dtype=torch_dtype), libraries, "lm_head",
                         not_loadable))
    return Explanation(device, torch_dtype, decisions, routes, libraries_text(libraries),
                       not_loadable)


def _route(device: DeviceInfo, op: str, spec: Any, libraries: LibraryAssumption, layer: str,
           not_loadable: str | None) -> Route:
    """The layer's route; with nothing that can run it (or an unloadable model), its ideal."""
    registry = default_registry()
    if not_loadable is None:
        try:
            return explain_op(device, op, spec, libraries, layer=layer)
        except BackendError:
            pass
    ideal = registry.ideal(op, device, spec)
    return Route(op=op, layer=layer, backend="", ideal=ideal,
                 ideal_detail=_detail(op, ideal, device, spec))
