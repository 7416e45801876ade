"""The dense linear route of a loaded model: select it, tune it for the decode graphs, and
install it as the routine every ``Linear`` computes through.

Selection is the registry's (ARCHSERVE_LINEAR_BACKEND overrides it, as for every op).
A routine that can be tuned (TRITON_SKINNY_GEMM) times its kernel against cuBLAS on the
model's own weights for each decode graph size it covers; the result is cached next to
the compiled kernels of this device, so a second start reads it.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from archserve.engine.kernel_cache import device_kernel_dir
from archserve.kernels.catalog import default_registry, select_linear_backend
from archserve.kernels.linear.cpu_weight_only import TIMED_ROWS
from archserve.kernels.linear.quantized_tuning import tune_quantized
from archserve.kernels.linear.quantized_weights import weight_signature
from archserve.kernels.linear.skinny_choice import LINEAR, SILU_MUL, WeightGroups
from archserve.kernels.specs import LinearSpec
from archserve.models.layers.embedding import LMHead
from archserve.models.layers.linear import (
    GateUpLinear,
    Linear,
    apply_linear_float,
    set_linear_routine,
)
from archserve.platform import DeviceInfo
from archserve.platform.decision import Decision
from archserve.quant.linear_state import quantized_layers
from archserve.quant.plan import QuantPlan, lm_head_decision, lm_head_spec


def linear_weights_by_shape(model: torch.nn.Module) -> WeightGroups:
    """Every weight that goes through the linear routine, grouped by (kind, out_features,
    in_features, dtype): a GateUpLinear's GEMM is followed by silu * mul, the others are
    plain (MoE routers included). A weight shared by two modules (a tied LM head) counts
    once."""
    from archserve.models.layers.moe import Router
    groups: WeightGroups = {}
    seen: set[int] = set()
    for module in model.modules():
        if (not isinstance(module, (Linear, LMHead, Router)) or getattr(module, "quant", None)
                is not None or id(module.weight) in seen):
            continue
        seen.add(id(module.weight))
        w = module.weight
        kind = SILU_MUL if isinstance(module, GateUpLinear) else LINEAR
        groups.setdefault((kind, w.shape[0], w.shape[1], w.dtype), []).append(w)
    return groups


def install_quantized_kernels(device: DeviceInfo, model: torch.nn.Module, plan: QuantPlan
                              ) -> list[Decision]:
    """Give every quantized layer the kernel the plan selected for its kind of layer (the
    selection ``explain`` and the start-up decisions show). A layer whose shape that
    kernel cannot take (a dimension it needs divisible) gets the next candidate for its
    own shape; each such exception is returned as a decision."""
    registry = default_registry()
    kinds = {layer.quant: layer for layer in plan.layers if layer.selection is not None}
    impls: dict[tuple, tuple[str, object]] = {}
    decisions = []
    chosen = []
    for name, state in quantized_layers(model):
        kind = kinds.get(state.quant)
        if kind is None:
            raise ValueError(f"{name}: no kernel was selected for {state.quant.describe()}")
        spec = dataclasses.replace(kind.spec, in_features=state.in_features,
                                   out_features=sum(state.rows))
        backend = kind.selection.backend
        why = backend.check(device, spec)
        if why is not None:
            backend = registry.select("linear", device, spec).backend
            decisions.append(Decision(f"quantized linear {name}", kind.selection.name,
                                      backend.name, why))
        key = (backend.name, state.quant)
        if key not in impls:
            impls[key] = (backend.name, backend.make_impl(device, spec))
        chosen.append((state, impls[key]))
    for name, impl in {id(impl): (name, impl) for _s, (name, impl) in chosen}.values():
        tune = getattr(impl, "tune_formats", None)     # CPU_WEIGHT_ONLY: storage per shape
        if tune is not None:
            weights = [state.weight for state, (_n, each) in chosen if each is impl]
            path = os.path.join(device_kernel_dir(device), "cpu_weight_formats.json")
            decisions.append(Decision("CPU weight formats", name, name,
                                      describe_formats(tune(weights, path))))
    for state, (name, impl) in chosen:
        state.install_kernel(name, impl)
    return decisions


def describe_formats(timings: dict) -> str:
    """What CPU_WEIGHT_ONLY chose per kind of weight, with the times it chose from."""
    parts = []
    for key, timing in sorted(timings.items()):
        times = ", ".join(f"{f} {ms:.3f}" for f, ms in sorted(timing.ms.items(),
                                                             key=lambda item: item[1]))
        parts.append(f"{key}: {timing.chosen}" + (f" (ms a layer at {'+'.join(map(str, TIMED_ROWS))} rows: {times})"
                                                  if times else " (the only format)"))
    return "; ".join(parts) or "no weight to store"


def quantized_kinds(model: torch.nn.Module) -> list:
    """(routine, backend, prepared weights) for every kind of quantized layer whose routine
    takes tuned configs: one entry per routine, shape and weight signature."""
    kinds: dict[tuple, tuple] = {}
    for _name, state in quantized_layers(model):
        if not hasattr(state.kernel, "candidates"):
            continue
        w = state.prepared
        key = (id(state.kernel), w.out_features, w.in_features, weight_signature(w))
        kinds.setdefault(key, (state.kernel, state.kernel_name, []))[2].append(w)
    return list(kinds.values())


def tune_quantized_decode(device: DeviceInfo, model: torch.nn.Module, dtype: torch.dtype,
                          graph_sizes: list[int]) -> Decision | None:
    """Tune the quantized GEMMs at the decode graph sizes (cached per device)."""
    kinds = quantized_kinds(model)
    if not kinds or not graph_sizes:
        return None
    path = os.path.join(device_kernel_dir(device), "quantized_gemms.json")
    report = tune_quantized(kinds, graph_sizes, dtype, path)
    torch.cuda.empty_cache()
    names = ", ".join(sorted({backend for _routine, backend, _weights in kinds}))
    return Decision("quantized decode GEMMs", names, names, report.summary())


def tune_moe_decode(device: DeviceInfo, model: torch.nn.Module, graph_sizes: list[int]
                    ) -> Decision | None:
    """Tune the fused MoE's tiles at the decode graph sizes (cached per device)."""
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.tuning import MoEShape, tune_moe
    from archserve.models.layers.moe import FusedMoE

    shapes: dict[tuple, MoEShape] = {}
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
        if moe.quantized is not None and moe.quantized.weight_format != "mxfp4":
            continue    # the tuner times 16-bit and MXFP4 experts' tiles (their one kernel)
        impl = moe.impl()
        if not isinstance(impl, TritonFusedMoEImpl):
            continue
        w13, w2 = moe.operands()
        dtype = moe.w13.dtype if moe.quantized is None else moe.quant_dtype
        # Timed as it runs: a token's slots are its top k and the shared experts, with the
        # layer's activation and biases.
        shape = MoEShape([], w13, w2, moe.slots, moe.renormalize, dtype, moe.activation,
                         moe.biases())
        shapes.setdefault((shape.key(0), moe.renormalize), shape).impls.append(impl)
    if not shapes or not graph_sizes:
        return None
    path = os.path.join(device_kernel_dir(device), "moe_tiles.json")
    report = tune_moe(list(shapes.values()), graph_sizes, path)
    torch.cuda.empty_cache()
    return Decision("MoE tiles", "TRITON_FUSED_MOE", "TRITON_FUSED_MOE", report.summary())


def tune_mla_decode(device: DeviceInfo, attn_impl: object, model_config, dtype: torch.dtype,
                    kv_cache_dtype: str, block_size: int, graph_sizes: list[int],
                    torch_device: torch.device) -> Decision | None:
    """Choose the MLA decode kernel's tiles by timing, where TRITON_MLA decodes in CUDA
    graphs (kernels/mla/tuning.py; cached per device)."""
    mla, sparse = model_config.mla, getattr(model_config, "sparse_attention", None)
    if mla is None or not graph_sizes:
        return None       # (before the imports: Triton is not installed everywhere)
    from archserve.kernels.mla.triton_mla import TritonMlaImpl
    from archserve.kernels.mla.tuning import MlaShape, describe, tune_mla_tiles

    if not isinstance(attn_impl, TritonMlaImpl):
        return None
    path = os.path.join(device_kernel_dir(device), "mla_tiles.json")
    layout = getattr(attn_impl, "layout", None)
    if sparse is not None and layout is not None:
        # TRITON_MLA_SPARSE: the indexed kernel that its long-context decode steps run.
        shape = MlaShape(model_config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim,
                         dtype, "fp8_ds_mla" if layout.latent_fp8 else "auto", block_size,
                         sparse.index_topk, layout.index_dim)
        attn_impl.sparse_tiles, timing, source = tune_mla_tiles(shape, path, torch_device)
        torch.cuda.empty_cache()
        return Decision("MLA sparse decode tiles", "TRITON_MLA_SPARSE", "TRITON_MLA_SPARSE",
                        describe(timing, source, shape))
    if kv_cache_dtype not in ("auto", "fp8_e4m3"):
        return None
    shape = MlaShape(model_config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype,
                     kv_cache_dtype, block_size)
    attn_impl.tiles, timing, source = tune_mla_tiles(shape, path, torch_device)
    torch.cuda.empty_cache()
    return Decision("MLA decode tiles", "TRITON_MLA", "TRITON_MLA", describe(timing, source))


def install_linear_route(device: DeviceInfo, model: torch.nn.Module, dtype: torch.dtype,
                         graph_sizes: list[int]) -> Decision | None:
    """Select the dense linear backend, tune it for ``graph_sizes`` (empty: decode runs
    eager, nothing to tune) and install it. Returns, for a tunable backend, a decision
    saying what it chose."""
    spec = LinearSpec(dtype=dtype)
    selection = select_linear_backend(device, spec)
    routine = selection.backend.make_impl(device, spec)
    decision = None
    tune_rows = getattr(routine, "tune_rows", None)
    if tune_rows is not None:   # the CPU's form of a few rows' GEMM (cpu_rows.py)
        weights = [w for group in linear_weights_by_shape(model).values() for w in group]
        path = os.path.join(device_kernel_dir(device), "cpu_gemms.json")
        decision = Decision("GEMMs of a few rows", selection.name, selection.name,
                            tune_rows(weights, path))
    tune = getattr(routine, "tune", None)
    if tune is not None:
        if graph_sizes:
            path = os.path.join(device_kernel_dir(device), "decode_gemms.json")
            report = tune(linear_weights_by_shape(model), graph_sizes, path, dtype)
            torch.cuda.empty_cache()  # the timing graphs' outputs
            reason = report.summary()
        else:
            reason = "decode runs eager (no CUDA graphs): every GEMM is cuBLAS's"
        decision = Decision("decode GEMMs", selection.name, selection.name, reason)
    set_linear_routine(routine)
    return decision


def install_lm_head_route(device: DeviceInfo, model: torch.nn.Module, dtype: torch.dtype
                          ) -> Decision | None:
    """Where the registry gives the LM head a lower-precision candidate (``lm_head_spec``:
    CPU_WEIGHT_ONLY's 8-bit head), time it against the dense head as the installed linear
    route multiplies it (so after ``install_linear_route``) and give each head the row
    counts it wins; returns the decision, None where the head is dense by rule."""
    spec = lm_head_spec(device, dtype)
    if spec.quant_scheme is None:
        return None
    selection = default_registry().select("linear", device, spec)
    tune_head = getattr(selection.backend.make_impl(device, spec), "tune_head", None)
    if tune_head is None:
        return None
    path = os.path.join(device_kernel_dir(device), "cpu_lm_head.json")
    heads = {id(m.weight): m for m in model.modules()
             if isinstance(m, LMHead) and getattr(getattr(m, "tp", None), "size", 1) == 1}
    reasons = []
    for head in heads.values():
        route = tune_head(head.weight, lambda x, w=head.weight: apply_linear_float(x, w), path)
        if route is None:
            return None
        if route.rows:
            head.install_low_precision(route)
        reasons.append(route.describe())
    if not reasons:
        return None
    return lm_head_decision(spec, selection.name, "; ".join(dict.fromkeys(reasons)))
