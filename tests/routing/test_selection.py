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
from archserve.quant.config import explain_quant_config
from archserve.quant.plan import plan_quantization
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
    # Marlin is vLLM's kernel and rules only here: the ideal, never the route.
    assert s.ideal == "MARLIN" and s.name == "TRITON_WEIGHT_ONLY"


def _plan(profile: str, scheme: str, dtype=torch.bfloat16):
    device = get_profile(profile)
    return plan_quantization(device, explain_quant_config(None, scheme), dtype)


@pytest.mark.parametrize("profile,ideal,route", [
    ("v100", "TRITON_WEIGHT_ONLY", "TRITON_WEIGHT_ONLY"),     # the V100 path vLLM lacks
    ("t4", "MARLIN", "TRITON_WEIGHT_ONLY"), ("a100", "MARLIN", "TRITON_WEIGHT_ONLY"),
    ("l40s", "CUTLASS_FP8", "TORCH_SCALED_MM"), ("b200", "CUTLASS_FP8", "TORCH_SCALED_MM"),
    ("cpu", "TORCH_DEQUANT", "TORCH_DEQUANT")])
def test_fp8_dual_path(profile: str, ideal: str, route: str) -> None:
    dtype = torch.float16 if profile in ("v100", "t4") else torch.bfloat16
    (layer,) = _plan(profile, "fp8", dtype).layers
    assert (layer.selection.ideal, layer.selection.name) == (ideal, route)


def test_fp8_plan_records_the_weight_only_degradation() -> None:
    (decision,) = _plan("a100", "fp8").decisions
    assert decision.chosen == "TRITON_WEIGHT_ONLY"
    assert "MARLIN is not implemented in this build" in decision.reason
    assert "activations are not quantized: they stay bfloat16" in decision.reason


def test_int8_below_triton_int8_degrades_to_dequant() -> None:
    (decision,) = _plan("v100", "w8a8_int8", torch.float16).decisions
    assert decision.chosen == "TORCH_DEQUANT" and "TRITON_INT8" not in decision.reason
    assert "activations quantized as the checkpoint says" in decision.reason


def test_gguf_on_gpus_stays_quantized_and_on_cpus_is_dense() -> None:
    for profile in ("v100", "h100"):
        (layer,) = plan_quantization(get_profile(profile),
                                     explain_quant_config(None, "gguf", True, True),
                                     torch.float16).layers
        assert layer.selection.name == "TRITON_WEIGHT_ONLY"
    assert explain_quant_config(None, "gguf", True, keep_gguf_quantized=False) is None


def test_native_scheme_has_no_degradation() -> None:
    (decision,) = _plan("h100", "fp8_block").decisions
    assert decision.chosen == "TRITON_BLOCK_FP8"
    assert "activations" not in decision.reason.split(";")[-1]


def test_scheme_lookup() -> None:
    assert scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) == \
        "fp8_block"
    assert scheme_from_config({"quant_method": "awq"}) == "awq"
    assert scheme_from_config(None) is None
    assert get_scheme("NVFP4").name == "modelopt_fp4"
    with pytest.raises(ValueError, match="unknown quantization 'zzz'"):
        get_scheme("zzz")
    assert scheme_from_config({"quant_method": "hqq"}) == "hqq"   # unknown: not loadable
