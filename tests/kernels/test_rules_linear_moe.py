"""Linear (GEMM) backend rules and priorities (MoE's, against vLLM 0.33's oracle, are in
tests/models/test_moe_oracle.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from archserve.kernels.catalog import build_registry
from archserve.kernels.linear.cpu_rows import CpuRowsLinear
from archserve.kernels.specs import LinearSpec
from archserve.platform.device import Toolchain
from archserve.platform.profiles import get_profile

REGISTRY = build_registry()


def ideal(op: str, profile: str, spec) -> str | None:
    return REGISTRY.ideal(op, get_profile(profile), spec)


def test_dense_linear_is_the_tuned_skinny_gemm_on_gpus_and_torch_elsewhere() -> None:
    for profile in ("h100", "mi300x", "b200", "rtx5090"):
        s = REGISTRY.select("linear", get_profile(profile), LinearSpec(), libraries="all")
        assert s.name == "TRITON_SKINNY_GEMM"
    cpu = REGISTRY.select("linear", get_profile("cpu"), LinearSpec(), libraries="all")
    assert cpu.name == "TORCH_MATMUL"
    # the CPU's routine: F.linear, or its transposed form for the few row counts timed faster
    assert isinstance(cpu.backend.make_impl(get_profile("cpu"), LinearSpec()), CpuRowsLinear)
    # bf16 is SM80+ silicon; fp16 on a V100 takes the Triton route.
    v100 = REGISTRY.select("linear", get_profile("v100"), LinearSpec(), libraries="all")
    assert v100.name == "TORCH_MATMUL"
    assert v100.rejected[0].reason == "bfloat16 needs SM80+, device is SM70"
    assert REGISTRY.select("linear", get_profile("v100"), LinearSpec(dtype=torch.float16),
                           libraries="all").name == "TRITON_SKINNY_GEMM"
    # Without triton installed, the dense route is torch's, and says why.
    none = REGISTRY.select("linear", get_profile("h100"), LinearSpec(), libraries="none")
    assert none.name == "TORCH_MATMUL" and "triton" in none.rejected[0].reason


def test_fp8_linear_dual_path() -> None:
    fp8 = LinearSpec(quant_scheme="fp8", activation="dynamic_token")
    assert ideal("linear", "v100", replace(fp8, dtype=torch.float16)) == "TRITON_WEIGHT_ONLY"
    assert ideal("linear", "v100", fp8) == "TORCH_DEQUANT"       # bf16 needs SM80+
    assert ideal("linear", "t4", fp8) == "MARLIN"
    assert ideal("linear", "a100", fp8) == "MARLIN"
    assert ideal("linear", "l40s", fp8) == "CUTLASS_FP8"
    assert ideal("linear", "h100", fp8) == "CUTLASS_FP8"
    # CUTLASS is rules only in this build: torch._scaled_mm runs it.
    s = REGISTRY.select("linear", get_profile("h100"), fp8, libraries="all")
    assert s.name == "TORCH_SCALED_MM"
    assert [r.backend for r in s.rejected] == ["FLASHINFER_FP8", "CUTLASS_FP8"]
    # vLLM 0.33's FlashInfer FP8 GEMM: SM100+, per-tensor weight and activation scales.
    static = replace(fp8, activation="static_tensor")
    assert ideal("linear", "b200", static) == "FLASHINFER_FP8"
    assert ideal("linear", "b200", fp8) == "CUTLASS_FP8"
    # A weight-only fp8 checkpoint (no activation scales) is not a W8A8 kernel's.
    w8a16 = LinearSpec(quant_scheme="fp8", activation="none")
    s = REGISTRY.select("linear", get_profile("h100"), w8a16, libraries="all")
    assert s.name == "TRITON_WEIGHT_ONLY"
    assert "quantizes activations" in s.rejected[0].reason


def test_cutlass_fp8_needs_a_new_enough_runtime_on_ada() -> None:
    l40s = get_profile("l40s")
    old = replace(l40s, toolchain=replace(l40s.toolchain, runtime_version="12.1"))
    backend = REGISTRY.get("linear", "CUTLASS_FP8")
    assert backend.runtime_rule(old) == "needs CUDA runtime 12.4+, this build has 12.1"
    assert backend.runtime_rule(l40s) is None
    h100 = get_profile("h100")
    assert backend.runtime_rule(replace(h100, toolchain=Toolchain(runtime_version="12.1"))) \
        is None


def test_nvfp4_gemm_is_two_separate_families() -> None:
    nvfp4 = LinearSpec(quant_scheme="nvfp4")
    # vLLM 0.33 _POSSIBLE_NVFP4_KERNELS: FlashInfer CuTe-DSL (SM10x), FlashInfer CUTLASS
    # (SM100+), vLLM's CUTLASS (SM100 and SM120 builds), then Marlin weight-only.
    assert ideal("linear", "b200", nvfp4) == "FLASHINFER_CUTEDSL_NVFP4"
    assert ideal("linear", "rtx5090", nvfp4) == "FLASHINFER_CUTLASS_NVFP4"
    assert ideal("linear", "thor", nvfp4) == "FLASHINFER_CUTLASS_NVFP4"
    assert ideal("linear", "h100", nvfp4) == "MARLIN"
    cutlass = REGISTRY.get("linear", "CUTLASS_NVFP4")
    assert cutlass.hardware_rule(get_profile("rtx5090"), nvfp4) is None
    assert cutlass.hardware_rule(get_profile("thor"), nvfp4) is not None


def test_rules_only_gemm_backends_are_rows_of_one_table():
    """vLLM's quantized GEMMs that this build models without a kernel differ only in data:
    one class reads its row (formats, SM floor or families, CUDA runtime)."""
    from archserve.kernels.catalog import build_registry
    from archserve.kernels.linear.rules import _RULES_ONLY_GEMMS, RulesOnlyGemmBackend

    rules_only = {name: b for name, b in build_registry().backends("linear").items()
                  if not b.implemented}
    assert set(rules_only) == {row.name for row in _RULES_ONLY_GEMMS}
    for backend in rules_only.values():
        assert isinstance(backend, RulesOnlyGemmBackend)
        assert backend.formats == backend.row.formats
