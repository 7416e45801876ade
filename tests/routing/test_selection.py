"""Selection through the default registry: overrides, the environment, plug-ins, quantization."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from archserve.kernels.catalog import (
    build_registry,
    default_registry,
    select_attention_backend,
    select_linear_backend,
)
from archserve.kernels.registry import ENTRY_POINT_GROUP, BackendError
from archserve.kernels.specs import AttentionSpec, LinearSpec
from archserve.platform.profiles import get_profile
from archserve.quant.plan import fp8_path, plan_quantization
from archserve.quant.schemes import get_scheme, scheme_from_config

SPEC = AttentionSpec(head_size=128, dtype=torch.float16)


def test_default_registry_is_one_instance() -> None:
    assert default_registry() is default_registry()


def test_valid_override_is_used(monkeypatch) -> None:
    monkeypatch.delenv("ARCHSERVE_ATTENTION_BACKEND", raising=False)
    s = select_attention_backend(get_profile("h100"), SPEC, libraries="all",
                                 override="flex_attention")
    assert s.name == "FLEX_ATTENTION" and s.forced and s.ideal == "FLASH_ATTN"


def test_impossible_override_names_reason_and_valid_choices(monkeypatch) -> None:
    monkeypatch.delenv("ARCHSERVE_ATTENTION_BACKEND", raising=False)
    with pytest.raises(BackendError) as err:
        select_attention_backend(get_profile("v100"), SPEC, libraries="all",
                                 override="FLASH_ATTN")
    text = str(err.value)
    assert "needs SM80+, device is SM70" in text
    assert "TRITON_ATTN" in text and "TORCH_REFERENCE" in text and "FLASHINFER, " not in text


def test_unimplemented_override_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("ARCHSERVE_ATTENTION_BACKEND", raising=False)
    with pytest.raises(BackendError, match="not implemented in this build"):
        select_attention_backend(get_profile("h100"), SPEC, libraries="all",
                                 override="FLASH_ATTN")


def test_unknown_override_lists_the_choices(monkeypatch) -> None:
    monkeypatch.delenv("ARCHSERVE_ATTENTION_BACKEND", raising=False)
    with pytest.raises(BackendError, match="unknown attention backend 'XFORMERS'.*TRITON_ATTN"):
        select_attention_backend(get_profile("h100"), SPEC, override="XFORMERS")


def test_environment_override(monkeypatch) -> None:
    monkeypatch.setenv("ARCHSERVE_ATTENTION_BACKEND", "TORCH_REFERENCE")
    s = select_attention_backend(get_profile("h100"), SPEC, libraries="all")
    assert s.name == "TORCH_REFERENCE" and s.forced
    monkeypatch.setenv("ARCHSERVE_ATTENTION_BACKEND", "FLASHINFER")
    with pytest.raises(BackendError, match="SM80"):
        select_attention_backend(get_profile("t4"), SPEC, libraries="all")


def test_extra_reject_demotes_a_backend_into_the_trace(monkeypatch) -> None:
    monkeypatch.delenv("ARCHSERVE_ATTENTION_BACKEND", raising=False)
    s = select_attention_backend(
        get_profile("h100"), SPEC, libraries="all",
        extra_reject=lambda b: "failed warm-up" if b.name == "TRITON_ATTN" else None)
    assert s.name == "FLEX_ATTENTION"
    assert ("TRITON_ATTN", "failed warm-up") in [(r.backend, r.reason) for r in s.rejected]


def test_third_party_backend_through_an_entry_point(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    registry = build_registry()
    ep = importlib.metadata.EntryPoint(name="toy", group=ENTRY_POINT_GROUP,
                                       value="toy_attention_plugin:register")
    registry.load_entry_points([ep])
    assert "TOY_ATTN" in registry.backends("attention")
    cpu = get_profile("cpu")
    order = registry.priority("attention", cpu, SPEC)
    assert order[-2:] == ["TOY_ATTN", "TORCH_REFERENCE"]
    s = registry.select("attention", cpu, SPEC, override="toy_attn")
    assert s.name == "TOY_ATTN"
    with pytest.raises(BackendError, match="toy kernels need a GPU"):
        registry.select("attention", get_profile("cpu"),
                        AttentionSpec(head_size=64), override="TOY_ATTN")


def test_broken_plugin_is_skipped() -> None:
    registry = build_registry()
    ep = importlib.metadata.EntryPoint(name="broken", group=ENTRY_POINT_GROUP,
                                       value="no_such_module_anywhere:register")
    registry.load_entry_points([ep])
    assert set(registry.backends("attention")) == set(default_registry().backends("attention"))


def test_linear_selection_for_quantized_layers() -> None:
    s = select_linear_backend(get_profile("a100"), LinearSpec(quant_scheme="wna16"),
                              libraries="all")
    assert s.ideal == "MARLIN" and s.name == "TORCH_DEQUANT"


@pytest.mark.parametrize("profile,path", [("v100", "dequant"), ("t4", "marlin"),
                                          ("a100", "marlin"), ("l40s", "native"),
                                          ("b200", "native"), ("cpu", "dequant")])
def test_fp8_dual_path(profile: str, path: str) -> None:
    assert fp8_path(get_profile(profile)) == path


def test_fp8_plan_records_the_weight_only_degradation() -> None:
    plan = plan_quantization(get_profile("a100"), "fp8", torch.bfloat16)
    (decision,) = plan.decisions
    assert decision.chosen == "MARLIN"
    assert "needs SM89+, device is SM80" in decision.reason
    assert "weight-only" in decision.reason


def test_below_min_capability_degrades_to_dequant() -> None:
    plan = plan_quantization(get_profile("v100"), "awq", torch.float16)
    (decision,) = plan.decisions
    assert decision.chosen == "TORCH_DEQUANT" and "needs SM75+, device is SM70" in decision.reason


def test_gguf_is_dense_after_load_everywhere() -> None:
    for profile in ("v100", "h100", "cpu"):
        plan = plan_quantization(get_profile(profile), "gguf", torch.float16)
        assert plan.linear_spec.quant_scheme is None
        assert "dense route" in plan.decisions[0].reason


def test_native_scheme_has_no_degradation() -> None:
    plan = plan_quantization(get_profile("h100"), "fp8", torch.bfloat16)
    assert plan.decisions[0].chosen == "CUTLASS_FP8"


def test_scheme_lookup() -> None:
    assert scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) == \
        "fp8_block"
    assert scheme_from_config({"quant_method": "awq"}) == "awq"
    assert scheme_from_config(None) is None
    assert get_scheme("NVFP4").name == "modelopt_fp4"
    with pytest.raises(ValueError, match="unknown quantization 'zzz'"):
        get_scheme("zzz")
