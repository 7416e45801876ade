"""Explain: for a device (live or a profile) and a request or model, the route of every layer kind.

Each route names the backend this build runs under the library assumption, the
*ideal* backend by hardware rules alone, and why every earlier candidate lost. The
dict form is the JSON of ``archserve explain --json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import (
    BackendError,
    LibraryAssumption,
    Rejection,
    Selection,
    override_from_env,
)
from archserve.kernels.rules import device_text
from archserve.kernels.specs import (
    AttentionSpec,
    LinearSpec,
    LoRASpec,
    MoESpec,
)
from archserve.models.attention_facts import VisionAttention
from archserve.models.registry import architecture_unsupported, op_kinds_of_supported_architectures
from archserve.platform.decision import Decision
from archserve.platform.device import DeviceInfo
from archserve.quant.config import UnsupportedQuantization, explain_quant_config
from archserve.quant.plan import (
    QuantPlan,
    gguf_experts_decision,
    keeps_gguf_quantized,
    lm_head_decision,
    lm_head_spec,
    plan_quantization,
)
from archserve.quant.schemes import QuantScheme, compressed_tensors_form, find_scheme
from archserve.routing.dtypes import (
    dtype_name,
    kv_cache_refusal,
    model_kv_cache_default,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from archserve.routing.explain_inputs import (  # noqa: F401 - SelectionInputs re-exported
    DEFAULT_HEAD_SIZE,
    SIDE_SELECTIONS,
    SelectionInputs,
    check_op,
    parse_libraries,
)
from archserve.routing.model_summary import ModelSummary

# DeepSeek-V3's MLA: 128 heads over a 512-dim latent plus 64 rope dims (head 576).
DEEPSEEK_V3_MLA = dict(head_size=576, num_heads=128, num_kv_heads=1, use_mla=True,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                       v_head_dim=128)
# DeepSeek-V3.2's lightning indexer (--sparse-mla): top-2048 keys, 64 heads of 128.
DEEPSEEK_V32_INDEXER = dict(index_topk=2048, index_head_dim=128, index_num_heads=64)


def _lora_spec(inputs: SelectionInputs, dtype: torch.dtype) -> LoRASpec:
    return LoRASpec(dtype=dtype, max_loras=inputs.max_loras, max_lora_rank=inputs.max_lora_rank)


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
    inputs: SelectionInputs = field(default_factory=SelectionInputs)

    def to_dict(self) -> dict[str, Any]:
        return {"device": device_dict(self.device), "dtype": dtype_name(self.dtype),
                "libraries": self.libraries, "not_loadable": self.not_loadable,
                "inputs": self.inputs.to_dict(),
                "decisions": [d.to_dict() for d in self.decisions],
                "routes": [r.to_dict() for r in self.routes]}


def device_dict(device: DeviceInfo) -> dict[str, Any]:
    cap = device.capability
    out = {"id": device.id, "name": device.name, "platform": device.platform,
           "capability": None if cap is None else [cap.major, cap.minor]}
    if device.platform == "cpu":   # what its kernels vectorise with (CPU_WEIGHT_ONLY's rules)
        out["cpu_isa"] = device.features.cpu_isa()
    return out


def libraries_text(libraries: LibraryAssumption) -> str:
    if isinstance(libraries, frozenset):
        return ",".join(sorted(libraries))
    return libraries


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
                       override: str | None = None, quantization: str | None = None,
                       inputs: SelectionInputs | None = None, sparse_mla: bool = False
                       ) -> Explanation:
    """``explain --op OP``: one layer of any op kind the registry routes, dtype decisions
    first. Attention takes Llama-3-8B's head size unless given (MLA assumes DeepSeek-V3's);
    linear and MoE take Llama-3-8B's and Mixtral-8x7B's shapes, quantized as
    ``quantization`` says.
    ``vit_attention`` and ``mla_prefill`` are vLLM's two side selections (their vLLM
    backends are rules only; mla_prefill's route is what archserve runs for MLA prompts)."""
    inputs = inputs or SelectionInputs()
    check_op(op, head_size)
    torch_dtype, decisions = resolve_dtype(device, dtype)
    if op in SIDE_SELECTIONS:
        return _side_selection(device, op, head_size, torch_dtype, decisions, libraries, inputs)
    if op == "lora":   # every architecture's dense linears take adapters
        spec = _lora_spec(inputs, torch_dtype)
        route = (explain_op(device, op, spec, libraries, override=override) if override
                 else _route(device, op, spec, libraries, "lora (adapters)", None))
        return Explanation(device, torch_dtype, decisions, [route], libraries_text(libraries),
                           None, inputs)
    # As in doctor: an op no loadable architecture has gets its ideal, never a route.
    not_loadable = (None if op in op_kinds_of_supported_architectures()
                    else f"no supported architecture has {op} layers")
    if op in ("linear", "moe"):
        plan = _quantization_plan(device, None, quantization, False, torch_dtype, libraries)
        scheme = find_scheme(quantization) if quantization else None
        if plan.not_loadable and (scheme is None or plan.layers):
            raise ValueError(plan.not_loadable)
        # A scheme this build does not load still has vLLM's ideal: its kernel form's.
        not_loadable = not_loadable or plan.not_loadable
        form = plan if not plan.refused else SchemeForm.of(scheme, None)
        routes = (_linear_routes(device, form, torch_dtype, libraries, not_loadable)
                  if op == "linear"
                  else [_moe_route(device, _moe_spec(inputs, dtype=torch_dtype,
                                                     quant_scheme=form.moe_format,
                                                     activation=form.moe_activation),
                                   libraries, not_loadable)])
        decisions = decisions + plan.decisions
        if scheme is not None:
            _vllm_refusal(device, scheme, routes, decisions)
        if override and not_loadable is None:
            routes = [explain_op(device, op, route_spec, libraries, layer=route.layer,
                                 override=override)
                      for route, route_spec in zip(
                          routes, _specs_of(op, plan, torch_dtype, inputs), strict=True)]
        return Explanation(device, torch_dtype, decisions, routes,
                           libraries_text(libraries), not_loadable, inputs)
    sparse = sparse_mla and op == "mla_attention"
    kv, kv_decisions = resolve_kv_cache_dtype(device, kv_cache_dtype, sparse_mla=sparse)
    shape: dict[str, Any] = dict(DEEPSEEK_V3_MLA) if op == "mla_attention" else {}
    if sparse:
        shape.update(DEEPSEEK_V32_INDEXER)
    if head_size is not None:
        shape["head_size"] = head_size
    elif op == "attention":
        shape["head_size"] = DEFAULT_HEAD_SIZE
        decisions = decisions + [Decision(
            "head size", "not given", str(DEFAULT_HEAD_SIZE),
            "Llama-3-8B's attention (32 query, 8 KV heads), as --op linear takes Llama-3-8B's "
            "shapes; --head-size sets another")]
    num_heads, num_kv_heads = inputs.per_rank_heads(shape.get("num_heads", 32),
                                                    shape.get("num_kv_heads", 8))
    shape.update(num_heads=num_heads, num_kv_heads=num_kv_heads)
    spec = AttentionSpec(dtype=torch_dtype, kv_cache_dtype=kv, block_size=block_size,
                         mla_sparse=sparse, **shape, **inputs.attention_fields())
    not_loadable = not_loadable or kv_cache_refusal(kv, sparse)
    route = (explain_op(device, op, spec, libraries, override=override)
             if override and not_loadable is None
             else _route(device, op, spec, libraries, op, not_loadable))
    return Explanation(device, torch_dtype, decisions + kv_decisions, [route],
                       libraries_text(libraries), not_loadable, inputs)


def _side_selection(device: DeviceInfo, op: str, head_size: int | None, dtype: torch.dtype,
                    decisions: list[Decision], libraries: LibraryAssumption,
                    inputs: SelectionInputs) -> Explanation:
    """``explain --op vit_attention | mla_prefill``: one of vLLM's side selections alone."""
    if op == "vit_attention":
        route = vit_route(device, VisionAttention(head_size, 16), dtype)
        not_loadable = f"no supported architecture has {op} layers"
    else:
        route = side_route(device, op, AttentionSpec(dtype=dtype, **DEEPSEEK_V3_MLA),
                           libraries, None)
        not_loadable = None
    return Explanation(device, dtype, decisions, [route], libraries_text(libraries),
                       not_loadable, inputs)


def vit_route(device: DeviceInfo, vision: VisionAttention, dtype: torch.dtype,
              layer: str = "vit_attention") -> Route:
    """A vision encoder's attention: vLLM's ViT priority list as the ideal; no route, as
    archserve runs a multimodal checkpoint's text decoder only."""
    spec = AttentionSpec(head_size=vision.head_size, dtype=dtype, attn_type="encoder_only",
                         num_heads=vision.num_heads, num_kv_heads=vision.num_heads)
    route = side_route(device, "vit_attention", spec, "all", None, layer)
    route.rejected.append(Rejection("archserve", "no vision encoder runs in this build: a "
                                                 "multimodal checkpoint loads its text decoder"))
    return route


def side_route(device: DeviceInfo, op: str, spec: AttentionSpec, libraries: LibraryAssumption,
               not_loadable: str | None, layer: str | None = None) -> Route:
    """vLLM's ViT-encoder and MLA-prefill selections: each has its own priority list and asks
    fewer questions than decoder attention. MLA prompts run what the model's mla_attention
    route runs for them (nothing where the model cannot load); a ViT has no route here."""
    from archserve.kernels.attention.backends import vit_attention_priority, vit_rule
    from archserve.kernels.mla.backends import mla_prefill_priority, mla_prefill_rule

    if op == "vit_attention":
        order, rule = vit_attention_priority(device), vit_rule
        if not device.is_cuda:
            order = ["TORCH_SDPA"]
    else:
        order, rule = mla_prefill_priority(device, spec), mla_prefill_rule
    rejected: list[Rejection] = []
    ideal = None
    for name in order:
        reason = rule(name, device, spec)
        if reason is None:
            ideal = name
            break
        rejected.append(Rejection(name, reason))
    backend = ""
    if op == "mla_prefill" and not_loadable is None:
        from archserve.kernels.mla.backends import mla_prefill_runs
        try:
            selection = default_registry().select("mla_attention", device, spec,
                                                  libraries=libraries)
            backend = mla_prefill_runs(selection.name)
        except BackendError as exc:
            rejected.append(Rejection("mla_attention", str(exc)))
    return Route(op=op, layer=layer or op, backend=backend, ideal=ideal, rejected=rejected)


def _moe_spec(inputs: SelectionInputs, **fields: Any) -> MoESpec:
    return MoESpec(tensor_parallel_size=inputs.tensor_parallel_size,
                   expert_parallel=inputs.expert_parallel,
                   batch_invariant=inputs.batch_invariant, **fields)


def _specs_of(op: str, plan: QuantPlan, dtype: torch.dtype, inputs: SelectionInputs
              ) -> list[Any]:
    """The spec behind each route ``explain_op_request`` lists for linear or MoE."""
    if op == "moe":
        return [_moe_spec(inputs, dtype=dtype, quant_scheme=plan.moe_format,
                          activation=plan.moe_activation)]
    return [layer.spec for layer in plan.layers] or [LinearSpec(dtype=dtype)]


def _quantization_plan(device: DeviceInfo, checkpoint_config: dict[str, Any] | None,
                       quantization: str | None, is_gguf: bool, dtype: torch.dtype,
                       libraries: LibraryAssumption) -> QuantPlan:
    """The plan of the checkpoint's (or the requested) quantization; an unloadable scheme
    gives an empty plan whose ``not_loadable`` says why."""
    try:
        quant = explain_quant_config(checkpoint_config, quantization, is_gguf,
                                     keep_gguf_quantized=keeps_gguf_quantized(device, dtype))
    except UnsupportedQuantization as exc:
        return QuantPlan(None, refused=str(exc))
    return plan_quantization(device, quant, dtype, libraries)


@dataclass(frozen=True)
class SchemeForm:
    """A checkpoint this build does not load, as vLLM's kernels see it: its linear layers'
    and experts' weight formats and activation quantization, so ``explain`` shows vLLM's
    choice for it on any device (quant/schemes.py's table, or a compressed-tensors config's
    own groups)."""

    linear_format: str | None
    activation: str
    moe_format: str | None
    moe_activation: str

    @classmethod
    def of(cls, scheme: QuantScheme, checkpoint: dict[str, Any] | None) -> SchemeForm:
        form = compressed_tensors_form(checkpoint) if scheme.name == "compressed-tensors" \
            else None
        if form is not None:
            return cls(*form, *form)
        return cls(scheme.weight_format, scheme.activation, scheme.moe_format,
                   scheme.moe_activation)

    def linear_specs(self, dtype: torch.dtype) -> list[LinearSpec]:
        if self.linear_format is None:
            return []             # the scheme leaves linear layers 16-bit
        return [LinearSpec(dtype=dtype, quant_scheme=self.linear_format,
                           activation=self.activation)]


def _linear_routes(device: DeviceInfo, plan: QuantPlan | SchemeForm, dtype: torch.dtype,
                   libraries: LibraryAssumption, not_loadable: str | None) -> list[Route]:
    """One route per quantized layer kind of the plan, or the dense linear route."""
    if isinstance(plan, SchemeForm):
        return [_route(device, "linear", spec, libraries, "linear (qkv, o, mlp)", not_loadable)
                for spec in plan.linear_specs(dtype)] or _linear_routes(
            device, QuantPlan(None), dtype, libraries, not_loadable)
    if not plan.layers:
        return [_route(device, "linear", LinearSpec(dtype=dtype), libraries,
                       "linear (qkv, o, mlp)", not_loadable)]
    return [_route(device, "linear", layer.spec, libraries,
                   "linear (qkv, o, mlp)" if len(plan.layers) == 1
                   else f"linear ({layer.quant.describe()})", not_loadable)
            for layer in plan.layers]


def _vllm_refusal(device: DeviceInfo, scheme: QuantScheme, routes: list[Route],
                  decisions: list[Decision]) -> None:
    """Where vLLM 0.33 refuses the scheme on this device, its quantized layers have no
    ideal, and one decision says so and what archserve does instead."""
    quantized = [r for r in routes if r.layer != "lm_head" and (
        (r.op == "moe" and scheme.moe_format is not None)
        or (r.op == "linear" and r.ideal not in ("TRITON_SKINNY_GEMM", "TORCH_MATMUL")))]
    reason = scheme.vllm_refusal(device) or next(
        (f"none of its kernels for the {r.layer} runs on {device_text(device)}"
         for r in quantized if r.ideal is None), None)
    if reason is None:
        return
    for route in quantized:
        route.ideal, route.ideal_detail = None, ""
    # The plan's own lines name the hardware-rule ideal; with vLLM refusing, there is none.
    decisions[:] = [replace(d, reason=d.reason.split("; ", 1)[-1])
                    if d.what == "quantization" and d.reason.startswith("ideal ") else d
                    for d in decisions]
    runs = sorted({r.backend for r in quantized if r.backend})
    if runs:
        instead = f"archserve degrades to {', '.join(runs)}"
    elif scheme.dequantized_at_load or (scheme.name == "gguf" and not quantized):
        instead = "archserve degrades to dequantizing it at load (dense layers)"
    else:
        instead = "archserve does not run it either"
    decisions.append(Decision("quantization", scheme.name, ", ".join(runs) or "-",
                              f"vLLM 0.33 refuses: {reason}; {instead}"))


def _moe_route(device: DeviceInfo, spec: MoESpec, libraries: LibraryAssumption,
               not_loadable: str | None) -> Route:
    return _route(device, "moe", spec, libraries, "moe experts", not_loadable)


def explain_model(device: DeviceInfo, model: ModelSummary, dtype: str = "auto",
                  kv_cache_dtype: str = "auto", quantization: str | None = None,
                  libraries: LibraryAssumption = "installed",
                  inputs: SelectionInputs | None = None) -> Explanation:
    """One route per layer kind of the model: attention (or MLA), linear, MoE, lm_head.

    A model this build cannot load (architecture or quantization) gets no route: the
    explanation says why in ``not_loadable`` and shows each layer's ideal backend only.
    """
    facts = model.attention_facts
    inputs = (inputs or SelectionInputs()).for_model(facts)
    torch_dtype, decisions = resolve_dtype(device, dtype, model.dtype)
    kv, kv_decisions = resolve_kv_cache_dtype(
        device, kv_cache_dtype, facts.checkpoint_kv_cache_dtype, model.mla_sparse,
        model_kv_cache_default(model.architecture, device))
    decisions += kv_decisions
    not_loadable = architecture_unsupported(model.architecture)
    plan = _quantization_plan(device, model.quantization_config, quantization, model.is_gguf,
                              torch_dtype, libraries)
    experts = None
    has_moe = False
    if not_loadable is None:
        from archserve.models.registry import model_class_for
        from archserve.quant.plan import quantized_experts_refusal
        has_moe = "moe" in getattr(model_class_for(model.architecture), "op_kinds", ())
        experts = quantized_experts_refusal(plan.config, has_moe)
    not_loadable = "; ".join(filter(None, [not_loadable, plan.not_loadable, experts])) or None
    if not_loadable is None:
        decisions += plan.decisions
    if model.is_gguf and plan.config is None and quantization in (None, "gguf"):
        decisions.append(Decision("quantization", "gguf", f"dense {dtype_name(torch_dtype)}",
                                  "archserve's GGUF loader dequantizes every tensor at load, so "
                                  "its linear layers take the dense route"))
    gguf_experts = gguf_experts_decision(model.is_gguf, has_moe, torch_dtype)
    if gguf_experts is not None:
        decisions.append(gguf_experts)

    not_loadable = "; ".join(filter(None, [not_loadable, kv_cache_refusal(kv, model.mla_sparse)])
                             ) or None
    not_loadable = _tensor_parallel_layout(device, model, inputs.tensor_parallel_size,
                                           decisions, not_loadable)
    num_heads, num_kv_heads = inputs.per_rank_heads(model.num_heads, model.num_kv_heads)
    attention = AttentionSpec(
        head_size=model.head_size, dtype=torch_dtype, kv_cache_dtype=kv,
        num_heads=num_heads, num_kv_heads=num_kv_heads, **inputs.attention_fields(),
        sliding_window=model.sliding_window, logit_soft_cap=model.logit_soft_cap,
        use_mla=model.use_mla, mla_sparse=model.mla_sparse, kv_lora_rank=model.kv_lora_rank,
        qk_rope_head_dim=model.qk_rope_head_dim, qk_nope_head_dim=model.qk_nope_head_dim,
        v_head_dim=model.v_head_dim, index_topk=model.index_topk,
        index_head_dim=model.index_head_dim, index_num_heads=model.index_num_heads)
    op = "mla_attention" if model.use_mla else "attention"
    # DeepSeek V4: one route per attention layer kind (its spec fields replace MLA's).
    kinds = [(f"attention ({name})", replace(attention, **fields))
             for name, fields in model.attention_kinds] or [("attention", attention)]
    if not_loadable is None:
        # As at start-up: attention that no backend of this build runs refuses the model.
        try:
            for _, spec in kinds:
                default_registry().select(op, device, spec, libraries=libraries)
        except BackendError as exc:
            not_loadable = str(exc)
    routes = [_route(device, op, spec, libraries, layer, not_loadable) for layer, spec in kinds]
    if facts.encoder_decoder:
        for attn_type, layer in (("encoder", "encoder attention"),
                                 ("encoder_decoder", "cross attention")):
            routes.append(_route(device, "attention", replace(attention, attn_type=attn_type),
                                 libraries, layer, not_loadable))
    if model.use_mla and not model.attention_kinds:
        routes.append(side_route(device, "mla_prefill", attention, libraries, not_loadable,
                                 "attention (prefill)"))
    if facts.vision is not None:
        routes.append(vit_route(device, facts.vision, torch_dtype, "vision encoder attention"))
    scheme = find_scheme(quantization or model.quantization or "")
    # A checkpoint whose scheme this build refuses still has vLLM's ideal: its kernel form's.
    form = (SchemeForm.of(scheme, model.quantization_config)
            if plan.refused and scheme is not None else plan)
    routes += _linear_routes(device, form, torch_dtype, libraries, not_loadable)
    if model.is_moe:
        moe = _moe_spec(inputs, dtype=torch_dtype, quant_scheme=form.moe_format,
                        activation=form.moe_activation,
                        gated_activation=model.expert_activation,
                        expert_bias=model.expert_bias,
                        num_experts=model.num_experts, top_k=model.experts_per_token or 2,
                        hidden_size=model.hidden_size,
                        intermediate_size=model.intermediate_size)
        routes.append(_moe_route(device, moe, libraries, not_loadable))
    # lm_head stays unquantized in every scheme archserve loads (as in vLLM by default),
    # except for the CPU's 8-bit copy of it where that is faster (lm_head_spec).
    head_spec = lm_head_spec(device, torch_dtype)
    routes.append(_route(device, "linear", head_spec, libraries, "lm_head", not_loadable))
    head_decision = lm_head_decision(head_spec, routes[-1].backend)
    if head_decision is not None and not_loadable is None:
        decisions.append(head_decision)
    if inputs.enable_lora:
        routes.append(_route(device, "lora", _lora_spec(inputs, torch_dtype), libraries,
                             "lora (adapters)", not_loadable))
    if scheme is not None:
        _vllm_refusal(device, scheme, routes, decisions)
    return Explanation(device, torch_dtype, decisions, routes, libraries_text(libraries),
                       not_loadable, inputs)


def _tensor_parallel_layout(device: DeviceInfo, model: ModelSummary, size: int,
                            decisions: list[Decision], not_loadable: str | None) -> str | None:
    """Add the layout over ``size`` ranks to ``decisions``, or its refusal to
    ``not_loadable`` (returned). MoE and MLA models split too (their experts' channels,
    their heads), as the engine and ``doctor`` split them."""
    from archserve.distributed.layout import layout_decision, layout_problems
    if size == 1:
        return not_loadable
    problems = layout_problems(model, size)
    if problems:
        return "; ".join(filter(None, [not_loadable,
                                       f"tensor_parallel_size={size}: {'; '.join(problems)}"]))
    decisions.append(layout_decision(model, size, "cuda" if device.is_gpu else "cpu"))
    return not_loadable


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
    # Why nothing runs: every candidate's reason (hardware, availability or this build).
    rejected = [Rejection(name, reason) for name in registry.priority(op, device, spec)
                if (reason := registry.get(op, name).check(device, spec, libraries))]
    return Route(op=op, layer=layer, backend="", ideal=ideal, rejected=rejected,
                 ideal_detail=_detail(op, ideal, device, spec))
