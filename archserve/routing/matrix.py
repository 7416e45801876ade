"""The SM x feature matrix (seed 000 §5.3), generated from the selector's own rules.

Every cell asks a rule: a feature flag of `features_for`, a backend's
``hardware_rule`` with a representative spec, or a quantization scheme's
``hardware_rule`` (for a scheme archserve loads, its own quantization plan). The scheme rows
are quant/schemes.py's table, one row an entry. Nothing
here is typed per GPU, so the table cannot drift from what selection does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from archserve.kernels.attention.backends import flash_attn_version
from archserve.kernels.catalog import default_registry
from archserve.kernels.specs import AttentionSpec, LinearSpec, LoRASpec, MoESpec
from archserve.platform.device import DeviceInfo
from archserve.platform.profiles import get_profile
from archserve.quant.schemes import SCHEMES, get_scheme

# Representative requests: fp16 runs on every GPU generation, so only the silicon decides.
ATTENTION_SPEC = AttentionSpec(head_size=128, dtype=torch.float16)
MLA_SPEC = AttentionSpec(head_size=576, dtype=torch.float16, num_heads=128, num_kv_heads=1,
                         use_mla=True)
# DeepSeek-V3.2: 128 heads, the indexer's top-2048 of 64 heads of 128; in bf16 for vLLM's
# sparse kernels (all but two take bf16 only; their GPUs all have it), fp16 for archserve's
# Triton one, so that a GPU without bf16 shows what it runs.
SPARSE_MLA_SPEC = AttentionSpec(head_size=576, dtype=torch.bfloat16, num_heads=128,
                                num_kv_heads=1, use_mla=True, mla_sparse=True, index_topk=2048,
                                index_head_dim=128, index_num_heads=64)


SPARSE_MLA_ROWS = tuple((label, name, SPARSE_MLA_SPEC) for label, name in (
    ("FlashInfer MLA Sparse", "FLASHINFER_MLA_SPARSE"),
    ("FlashAttn-4 MLA Sparse", "FLASH_ATTN_MLA_SPARSE_FA4"),
    ("FlashMLA Sparse", "FLASHMLA_SPARSE"),
    ("FlashAttn MLA Sparse", "FLASH_ATTN_MLA_SPARSE"),
    ("FlashInfer MLA Sparse SM90", "FLASHINFER_MLA_SPARSE_SM90"),
    ("FlashInfer MLA Sparse SM120", "FLASHINFER_MLA_SPARSE_SM120"),
)) + (("Triton MLA Sparse", "TRITON_MLA_SPARSE", replace(SPARSE_MLA_SPEC, dtype=torch.float16)),)
# DeepSeek V4 (a compressed sparse layer of V4-Flash: 64 heads of 512, top-512 of 64 indexer
# heads of 128, sinks), bf16 for vLLM's V4 kernels; FlashInfer's on SM12x with its fp8 cache
# (its SM100 row: the 16-bit one); fp16 for archserve's Triton route.
DSV4_SPEC = AttentionSpec(head_size=512, dtype=torch.bfloat16, num_heads=64, num_kv_heads=1,
                          use_mla=True, mla_sparse=True, compress_rate=4, index_topk=512,
                          index_head_dim=128, index_num_heads=64, has_sinks=True)
DSV4_ROWS = (
    ("FlashMLA Sparse DSV4", "FLASHMLA_SPARSE_DSV4", DSV4_SPEC),
    ("FlashInfer MLA Sparse DSV4 (bf16)", "FLASHINFER_MLA_SPARSE_DSV4", DSV4_SPEC),
    ("FlashInfer MLA Sparse DSV4 (fp8_ds_mla)", "FLASHINFER_MLA_SPARSE_DSV4",
     replace(DSV4_SPEC, kv_cache_dtype="fp8_ds_mla")),
    ("Triton MLA Sparse DSV4", "TRITON_MLA_SPARSE_DSV4", replace(DSV4_SPEC, dtype=torch.float16)),
)


@dataclass(frozen=True)
class MatrixRow:
    group: str
    name: str
    rule: Callable[[DeviceInfo], str | None]      # None: supported, else the reason
    implemented: bool = True
    note: Callable[[DeviceInfo], str] | None = None  # extra text for a supported cell


def _feature(flag: str) -> Callable[[DeviceInfo], str | None]:
    return lambda d: None if getattr(d.features, flag) else f"no {flag}"


def _backend(op: str, name: str, spec: Any) -> MatrixRow:
    """A backend's row: vLLM's hardware rule for one archserve only knows as rules; for one
    this build runs, also where its kernels run (Triton's SM70+ code, its build rule), so a
    cell never says supported where ``explain`` would refuse."""
    backend = default_registry().get(op, name)
    return MatrixRow("", name, _cell_rule(backend, spec, backend.implemented),
                     backend.implemented)


def _cell_rule(backend: Any, spec: Any, built: bool) -> Callable[[DeviceInfo], str | None]:
    if not built:
        return lambda d: backend.hardware_rule(d, spec)
    return lambda d: (backend.hardware_rule(d, spec) or backend.availability(d, "all")
                      or backend.build_rule(d, spec))


def _row(group: str, name: str, base: MatrixRow, note: Callable[[DeviceInfo], str] | None = None
         ) -> MatrixRow:
    return MatrixRow(group, name, base.rule, base.implemented, note or base.note)


# The activation quantization each format's native (W8A8) kernels are built for.
_ACTIVATION_OF = {"fp8": "dynamic_token", "fp8_block": "dynamic_group", "int8": "dynamic_token"}


def _linear(fmt: str) -> LinearSpec:
    return LinearSpec(dtype=torch.float16, quant_scheme=fmt,
                      activation=_ACTIVATION_OF.get(fmt, "none"))


def _moe(fmt: str | None) -> MoESpec:
    return MoESpec(dtype=torch.float16, quant_scheme=fmt)


def _scheme(group: str, scheme: str) -> MatrixRow:
    """A scheme's row (quant/schemes.py's table). One archserve loads is supported where
    this build runs it (the quantization plan's route on the silicon, as ``explain
    --quantization`` routes it: GGUF and the dequantizing CPU path run on CPUs, which vLLM's
    kernels do not); one it does not load keeps vLLM's hardware rule."""
    found = get_scheme(scheme)
    if not found.loadable:
        return MatrixRow(group, found.display, found.hardware_rule, False)
    return MatrixRow(group, found.display,
                     lambda device: _archserve_scheme_rule(scheme, device), True,
                     lambda device: _archserve_scheme_route(scheme, device))


def _kernel_path(group: str, name: str, backend: str, spec: LinearSpec) -> MatrixRow:
    """One of a scheme's kernel paths (seed 000 §5.2: native W8A8, or weight-only), as the
    kernel that takes it; a kernel this build has names itself in the cell."""
    base = _backend("linear", backend, spec)
    return MatrixRow(group, name, base.rule, base.implemented,
                     (lambda device: backend) if base.implemented else None)


def _scheme_plan(scheme: str, device: DeviceInfo):  # noqa: ANN202 - a QuantPlan
    from archserve.quant.config import explain_quant_config
    from archserve.quant.plan import keeps_gguf_quantized, plan_quantization
    from archserve.routing.dtypes import resolve_dtype
    dtype, _ = resolve_dtype(device, "auto")
    config = explain_quant_config(None, scheme, is_gguf=scheme == "gguf",
                                  keep_gguf_quantized=keeps_gguf_quantized(device, dtype))
    return plan_quantization(device, config, dtype, "all")


def _archserve_scheme_rule(scheme: str, device: DeviceInfo) -> str | None:
    return _scheme_plan(scheme, device).not_loadable


def _archserve_scheme_route(scheme: str, device: DeviceInfo) -> str:
    """The linear kernels of the scheme's layers; for a scheme of routed experts alone
    (MXFP4), the MoE kernel that runs them; else "dense after load"."""
    plan = _scheme_plan(scheme, device)
    route = ", ".join(sorted({layer.selection.name for layer in plan.layers
                              if layer.selection is not None}))
    if not route and plan.moe_format is not None:
        experts = default_registry().select("moe", device, _moe(plan.moe_format),
                                            libraries="all")
        return f"experts: {experts.name}"
    return route or "dense after load"


SINKS_SPEC = AttentionSpec(head_size=64, dtype=torch.float16, has_sinks=True)
VIT_SPEC = AttentionSpec(head_size=72, dtype=torch.float16, attn_type="encoder_only")
MLA_PREFILL_SPEC = MLA_SPEC


def _sinks(name: str) -> MatrixRow:
    """A backend's row for attention with learned sinks (gpt-oss's head size 64): rules
    only where archserve's kernel of that name lacks them."""
    backend = default_registry().get("attention", name)
    built = backend.implemented and backend.build_rule(get_profile("h100"), SINKS_SPEC) is None
    return MatrixRow("", name, _cell_rule(backend, SINKS_SPEC, built), built)


def _side(op: str, spec: AttentionSpec) -> MatrixRow:
    """One of vLLM's side selections (ViT attention, MLA prefill): supported where its list
    has an ideal, which the cell names. Rules only: archserve runs no ViT, and its MLA
    prompts run its own Triton prefill rather than vLLM's choice."""
    from archserve.routing.explain import side_route

    def ideal(device: DeviceInfo) -> str | None:
        return side_route(device, op, spec, "all", "matrix").ideal

    return MatrixRow("", op, lambda d: None if ideal(d) else f"no {op} backend",
                     False, lambda d: _SHORT_NAMES.get(ideal(d) or "", ideal(d) or ""))


# Cell notes are a few characters wide.
_SHORT_NAMES = {"FLASH_ATTN": "FA", "TORCH_SDPA": "SDPA", "TRITON_ATTN": "Triton",
                "FLASHINFER": "FI", "TRTLLM_RAGGED": "TRT"}


def _fa_version(device: DeviceInfo) -> str:
    return f"FA{flash_attn_version(device, ATTENTION_SPEC)}"


def matrix_rows() -> list[MatrixRow]:
    dt, att, mla, gemm, moe, quant = ("Data types", "Attention backends", "MLA backends",
                                      "GEMM paths", "MoE kernels", "Quantization schemes")
    return [
        MatrixRow(dt, "FP32", _feature("fp32")),
        MatrixRow(dt, "FP16", _feature("fp16")),
        MatrixRow(dt, "BF16", _feature("bf16")),
        MatrixRow(dt, "FP8 (E4M3)", _feature("fp8_e4m3")),
        MatrixRow(dt, "NVFP4", _feature("nvfp4")),
        MatrixRow(dt, "MXFP8", _feature("mxfp8")),
        _row(att, "FlashAttention", _backend("attention", "FLASH_ATTN", ATTENTION_SPEC),
             _fa_version),
        _row(att, "FlashInfer", _backend("attention", "FLASHINFER", ATTENTION_SPEC)),
        _row(att, "Triton Attn", _backend("attention", "TRITON_ATTN", ATTENTION_SPEC)),
        _row(att, "FlexAttention", _backend("attention", "FLEX_ATTENTION", ATTENTION_SPEC)),
        _row(att, "PyTorch SDPA", _backend("attention", "TORCH_SDPA", ATTENTION_SPEC)),
        _row(att, "PyTorch reference", _backend("attention", "TORCH_REFERENCE",
                                                ATTENTION_SPEC)),
        _row(att, "Sinks: FlashAttention", _sinks("FLASH_ATTN")),
        _row(att, "Sinks: FlashInfer", _sinks("FLASHINFER")),
        _row(att, "Sinks: Triton Attn", _sinks("TRITON_ATTN")),
        _row(att, "ViT attention (vLLM's ViT list)", _side("vit_attention", VIT_SPEC)),
        _row(mla, "MLA prefill (vLLM's prefill list)", _side("mla_prefill", MLA_PREFILL_SPEC)),
        _row(mla, "FlashAttn MLA", _backend("mla_attention", "FLASH_ATTN_MLA", MLA_SPEC)),
        _row(mla, "FlashMLA", _backend("mla_attention", "FLASHMLA", MLA_SPEC)),
        _row(mla, "CUTLASS MLA", _backend("mla_attention", "CUTLASS_MLA", MLA_SPEC)),
        _row(mla, "FlashInfer MLA", _backend("mla_attention", "FLASHINFER_MLA", MLA_SPEC)),
        _row(mla, "Triton MLA", _backend("mla_attention", "TRITON_MLA", MLA_SPEC)),
        *(_row(mla, label, _backend("mla_attention", name, spec))
          for label, name, spec in SPARSE_MLA_ROWS + DSV4_ROWS),
        _row(gemm, "INT8 W8A8", _backend("linear", "CUTLASS_INT8", _linear("int8"))),
        _row(gemm, "FP8 W8A8", _backend("linear", "CUTLASS_FP8", _linear("fp8"))),
        _row(gemm, "Block-wise FP8", _backend("linear", "CUTLASS_BLOCK_FP8",
                                              _linear("fp8_block"))),
        _row(gemm, "W4A8 mixed precision", _backend("linear", "CUTLASS_W4A8", _linear("w4a8"))),
        _row(gemm, "NVFP4 GEMM", _backend("linear", "CUTLASS_NVFP4", _linear("nvfp4"))),
        _row(gemm, "2:4 Sparse", _backend("linear", "CUTLASS_SPARSE_2_4",
                                          _linear("sparse_2_4"))),
        _row(gemm, "Grouped GEMM", _backend("linear", "CUTLASS_GROUPED_GEMM",
                                            _linear("grouped"))),
        _row(gemm, "Marlin (weight-only)", _backend("linear", "MARLIN", _linear("wna16"))),
        _row(gemm, "Triton weight-only (int4/int8/fp8)",
             _backend("linear", "TRITON_WEIGHT_ONLY", _linear("wna16"))),
        _row(gemm, "FP8 W8A8 (torch._scaled_mm)",
             _backend("linear", "TORCH_SCALED_MM", _linear("fp8"))),
        _row(gemm, "Block-wise FP8 (Triton)",
             _backend("linear", "TRITON_BLOCK_FP8", _linear("fp8_block"))),
        _row(gemm, "INT8 W8A8 (Triton)", _backend("linear", "TRITON_INT8", _linear("int8"))),
        _row(gemm, "Decode GEMV (Triton, fp16)", _backend("linear", "TRITON_SKINNY_GEMM",
                                                          LinearSpec(dtype=torch.float16))),
        _row(gemm, "Dense torch matmul", _backend("linear", "TORCH_MATMUL", LinearSpec())),
        _row(moe, "Triton fused_moe", _backend("moe", "TRITON_FUSED_MOE", _moe(None))),
        _row(moe, "CUTLASS MoE FP8", _backend("moe", "CUTLASS_MOE_FP8", _moe("fp8"))),
        # Block fp8: the format both of vLLM's TRT-LLM FP8 expert classes take (per-tensor
        # fp8 only with static activation scales, which _moe's spec does not have).
        _row(moe, "TRTLLM MoE FP8", _backend("moe", "TRTLLM_MOE_FP8", _moe("fp8_block"))),
        _row(moe, "TRTLLM MoE NVFP4", _backend("moe", "TRTLLM_MOE_NVFP4", _moe("nvfp4"))),
        _row(moe, "DeepGEMM MoE", _backend("moe", "DEEPGEMM_MOE", _moe("fp8_block"))),
        _row(moe, "Marlin MoE", _backend("moe", "MARLIN_MOE", _moe("wna16"))),
        _row(moe, "FlashInfer CUTLASS MoE", _backend("moe", "FLASHINFER_CUTLASS_MOE",
                                                     _moe("fp8"))),
        _row(moe, "FlashInfer CuteDSL MoE", _backend("moe", "FLASHINFER_CUTEDSL_MOE",
                                                     _moe("nvfp4"))),
        _row(moe, "TRTLLM MoE MXFP4", _backend("moe", "TRTLLM_MOE_MXFP4", _moe("mxfp4"))),
        _row(moe, "OpenAI Triton MXFP4 MoE", _backend("moe", "TRITON_MXFP4_MOE", _moe("mxfp4"))),
        _row(moe, "Triton fused_moe, MXFP4 weight-only",
             _backend("moe", "TRITON_FUSED_MOE", _moe("mxfp4"))),
        _row(moe, "PyTorch MoE", _backend("moe", "TORCH_MOE", _moe(None))),
        _row("LoRA adapters", "Triton shrink/expand (SGMV)",
             _backend("lora", "TRITON_LORA", LoRASpec(dtype=torch.float16))),
        _row("LoRA adapters", "PyTorch (every slot, masked)",
             _backend("lora", "TORCH_LORA", LoRASpec(dtype=torch.float16))),
        *(_scheme(quant, name) for name in SCHEMES),
        # The seed's FP8 and NVFP4 rows by path (§5.2): the kernel this build runs for a
        # path where it has one, else vLLM's (rules only).
        _kernel_path(quant, "FP8 (Marlin path)", "TRITON_WEIGHT_ONLY", _linear("fp8")),
        _kernel_path(quant, "FP8 (native)", "TORCH_SCALED_MM", _linear("fp8")),
        _kernel_path(quant, "NVFP4 quantization", "CUTLASS_NVFP4", _linear("nvfp4")),
        _kernel_path(quant, "NVFP4 (Marlin path)", "MARLIN", _linear("nvfp4")),
        _kernel_path(quant, "MXFP4 (Marlin path)", "MARLIN", _linear("mxfp4")),
        _kernel_path(quant, "MXFP4 (Triton weight-only)", "TRITON_WEIGHT_ONLY",
                     _linear("mxfp4")),
    ]


def build_matrix(devices: Sequence[DeviceInfo]) -> dict[str, Any]:
    """``{"profiles": [ids], "features": [{"group","name","support","implemented","notes"}]}``."""
    features = []
    for row in matrix_rows():
        support = {d.id: row.rule(d) is None for d in devices}
        notes = {d.id: row.note(d) for d in devices if support[d.id] and row.note}
        features.append({"group": row.group, "name": row.name, "support": support,
                         "implemented": row.implemented, "notes": notes})
    return {"profiles": [d.id for d in devices], "features": features}
