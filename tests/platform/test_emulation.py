"""Emulation (platform/emulation.py): a detected GPU narrowed to a profile's capabilities.

The GPU here is stood in for by the H200 profile (what ``detect()`` reports on the device
machine); everything below it is the real code: dtype and KV decisions, selection, explain,
the engine's route, the kernel wrappers' device questions, the kernel cache key.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from archserve.platform import emulation
from archserve.platform.detect import device_info_for
from archserve.platform.emulation import (
    EmulationRefused,
    compile_target,
    emulate,
    emulation_refusal,
    limit_violation,
    narrow,
)
from archserve.platform.profiles import get_profile
from archserve.routing.dtypes import resolve_dtype, resolve_kv_cache_dtype
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import read_model_summary

# The GPUs an H200 executes the route of: every older NVIDIA profile.
ON_AN_H200 = ("p40", "v100", "t4", "a100", "a10", "l40s", "rtx4090", "h100", "h200")
QUANT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant")


@pytest.fixture
def h200():
    """The GPU here: the H200 as detect() describes it (a live device's id)."""
    return dataclasses.replace(get_profile("h200"), id="live")


@pytest.fixture
def fresh_process(monkeypatch):
    """No engine of this process has fixed its emulation yet (restored afterwards)."""
    monkeypatch.setattr(emulation, "_fixed", None)
    monkeypatch.delenv(emulation.TRITON_ARCH_ENV, raising=False)


@pytest.mark.parametrize("present, profile, reason", [
    ("h200", "t4", None), ("h200", "v100", None), ("h200", "l40s", None),
    ("h200", "h100", None), ("b200", "l40s", None), ("gb10", "rtx5090", None),
    ("rtx5090", "rtx4090", None), ("mi300x", "mi300x", None),
    ("h200", "b200", "newer than this NVIDIA H200"),
    ("h200", "rtx5090", "SM120, newer than"),
    ("h200", "b300", "tcgen05"),
    ("b200", "h100", "uses wgmma"),
    ("rtx5090", "h200", "uses wgmma"),
    ("b200", "rtx5090", "newer than"),
    ("h200", "mi300x", "an AMD GPU"),
    ("mi300x", "t4", "an NVIDIA GPU"),
    ("h200", "cpu", "not a GPU"),
    ("cpu", "t4", "no GPU here"),
])
def test_what_a_gpu_can_emulate(present, profile, reason):
    got = emulation_refusal(get_profile(present), get_profile(profile))
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got


@pytest.mark.parametrize("profile_id", ON_AN_H200)
def test_narrowed_device_is_the_profiles_capability_model(h200, profile_id):
    profile = get_profile(profile_id)
    device = narrow(h200, profile)
    for name in ("id", "platform", "capability", "features", "shared_memory_per_block_bytes",
                 "registers_per_block", "multiprocessor_count"):
        assert getattr(device, name) == getattr(profile, name), name
    # What the silicon and the install decide stays the GPU's.
    assert device.memory_bytes == h200.memory_bytes and device.toolchain == h200.toolchain
    assert device.emulated_on == h200
    assert device.describe().endswith(f"emulated on {h200.describe()}")


@pytest.mark.parametrize("profile_id", ON_AN_H200)
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_emulated_dtypes_are_the_profiles(h200, profile_id, dtype):
    """V100 and T4 get float16 (bf16 asked for degrades, with its decision), the rest bf16;
    fp8 KV caches are kept as the profile keeps them."""
    profile, device = get_profile(profile_id), narrow(h200, get_profile(profile_id))
    assert resolve_dtype(device, dtype) == resolve_dtype(profile, dtype)
    assert resolve_dtype(device, dtype, "float16") == resolve_dtype(profile, dtype, "float16")
    for kv in ("auto", "fp8", "fp8_e5m2"):
        assert resolve_kv_cache_dtype(device, kv) == resolve_kv_cache_dtype(profile, kv)
    expected = torch.float16 if profile_id in ("p40", "v100", "t4") else (
        torch.bfloat16 if dtype == "auto" else getattr(torch, dtype))
    assert resolve_dtype(device, dtype)[0] == expected


def _write_config(tmp_path, name: str, **config) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model_summaries(tmp_path_factory):
    """A dense Llama, a Qwen3-MoE, a DeepSeek-V2 (MLA) and every quantized fixture form."""
    tmp = tmp_path_factory.mktemp("summaries")
    paths = {
        "llama": _write_config(tmp, "llama", model_type="llama", hidden_size=4096,
                               architectures=["LlamaForCausalLM"], num_attention_heads=32,
                               num_key_value_heads=8, torch_dtype="bfloat16"),
        "qwen3_moe": _write_config(tmp, "qwen3_moe", model_type="qwen3_moe",
                                   architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                                   head_dim=128, num_attention_heads=32, num_key_value_heads=4,
                                   num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=768, torch_dtype="bfloat16"),
        "deepseek_v2": _write_config(tmp, "deepseek_v2", model_type="deepseek_v2",
                                     architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
                                     num_attention_heads=16, num_key_value_heads=16,
                                     kv_lora_rank=512, qk_rope_head_dim=64,
                                     qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                                     num_experts_per_tok=6, moe_intermediate_size=1408,
                                     torch_dtype="bfloat16"),
    }
    for name in ("ct-fp8-channel-dynamic", "ct-fp8-block", "ct-int8-w8a8", "awq-w4-g64",
                 "gptq-w4-g128-sym", "ct-w4a16-g32-asym", "ct-moe-fp8-block", "ct-moe-w4a16",
                 "hf-deepseek-v3-fp8-block"):
        paths[name] = os.path.join(QUANT, name)
    paths["gguf"] = os.path.join(QUANT, "gguf-mixed", "tiny-mixed.gguf")
    return {name: read_model_summary(path) for name, path in paths.items()}


def _routes(explanation) -> list[dict]:
    return [route.to_dict() for route in explanation.routes]


@pytest.mark.parametrize("profile_id", ON_AN_H200)
def test_emulated_routes_are_what_explain_prints_for_the_profile(h200, model_summaries,
                                                               profile_id):
    """Every layer's backend, ideal and rejections (with their reasons), and every decision
    of dtype, KV cache and quantization: those of ``explain --device PROFILE``."""
    profile, device = get_profile(profile_id), narrow(h200, get_profile(profile_id))
    for name, summary in model_summaries.items():
        for kv in ("auto", "fp8"):
            ours = explain_model(device, summary, kv_cache_dtype=kv, libraries="installed")
            theirs = explain_model(profile, summary, kv_cache_dtype=kv)   # the CLI's default
            assert _routes(ours) == _routes(theirs), (name, kv)
            assert ours.dtype == theirs.dtype and ours.not_loadable == theirs.not_loadable
            assert [d.to_dict() for d in ours.decisions] == [
                d.to_dict() for d in theirs.decisions], (name, kv)


def test_emulation_changes_the_route_where_the_profile_differs(h200, model_summaries):
    """The same FP8 checkpoint on the GPU as it is and emulating an A100: FP8 tensor cores
    here, the weight-only FP8 route there (no FP8 below SM89)."""
    fp8 = model_summaries["ct-fp8-block"]
    native = {r.layer: r.backend for r in explain_model(h200, fp8).routes}
    a100 = {r.layer: r.backend for r in explain_model(narrow(h200, get_profile("a100")),
                                                      fp8).routes}
    assert native["linear (qkv, o, mlp)"] == "TRITON_BLOCK_FP8"
    assert a100["linear (qkv, o, mlp)"] == "TRITON_WEIGHT_ONLY"


@pytest.mark.parametrize("profile_id", ["t4", "a100", "l40s"])
def test_engine_route_is_explains_for_the_profile(h200, tiny_checkpoint, profile_id):
    """The route the engine prints at start-up (startup.model_routes, attention as its
    selection chose it) is explain's for the profile."""
    from archserve.engine import startup
    from archserve.engine.config import EngineConfig
    from archserve.loader.loader import load_model_config

    path = tiny_checkpoint("qwen3-h64")
    config = EngineConfig(model=path, emulate_device=profile_id)
    device = narrow(h200, get_profile(profile_id))
    model_config, _ = load_model_config(path)
    dtype, kv, _ = startup.resolve_precision(device, config, model_config)
    selection = startup.select_attention(device, config, model_config, dtype, kv)
    printed = startup.model_routes(device, config, model_config, dtype, kv, selection)
    expected = explain_model(get_profile(profile_id), read_model_summary(path))
    assert [r.to_dict() for r in printed] == _routes(expected)
    decision = startup.emulation_decision(device)
    assert decision.chosen == device.describe() and profile_id in decision.requested
    assert startup.emulation_decision(h200) is None


def test_emulated_kernel_cache_is_its_own(h200):
    from archserve.engine.kernel_cache import kernel_cache_key

    t4 = get_profile("t4")
    emulated = kernel_cache_key(narrow(h200, t4))
    assert emulated == kernel_cache_key(narrow(h200, t4))
    assert emulated not in (kernel_cache_key(h200), kernel_cache_key(t4))
    assert emulated != kernel_cache_key(narrow(h200, get_profile("a10")))


def test_kernel_wrappers_ask_the_platform(monkeypatch):
    """What kernel wrappers read of their GPU comes from device_info_for: under a compile
    target, a CPU tensor stands for the profile's GPU (tiles, features, launch options)."""
    from archserve.kernels.attention.triton_cache_write import e4m3_in_software
    from archserve.kernels.mla.triton_mla_decode import _max_stages
    from archserve.kernels.pdl import pdl_enabled

    cpu = torch.device("cpu")
    fp8 = torch.zeros(2, dtype=torch.float8_e4m3fn)
    assert device_info_for(cpu).platform == "cpu" and not pdl_enabled(cpu)
    answers = {}
    for profile_id in ("t4", "a100", "l40s", "h100"):
        with compile_target(get_profile(profile_id)) as profile:
            assert device_info_for(cpu) is profile
            answers[profile_id] = (pdl_enabled(cpu), e4m3_in_software(fp8), _max_stages(cpu))
    assert device_info_for(cpu).platform == "cpu"
    assert answers == {"t4": (False, True, 2), "a100": (False, True, 3),
                       "l40s": (False, False, 3), "h100": (True, False, 3)}
    monkeypatch.setenv("ARCHSERVE_PDL", "0")
    with compile_target(get_profile("h100")):
        assert not pdl_enabled(cpu)


def test_autotune_candidates_are_pruned_to_the_profiles_shared_memory():
    """The prefill autotuner keeps the tiles that fit the profile: an A10's 99 KiB drops the
    large one an H100 keeps. (A T4 does not autotune it: triton_prefill._prefill_tiles.)"""
    from triton_compile import AUTOTUNED, collected_launches

    from archserve.kernels.attention.triton_prefill import (
        PREFILL_CONFIGS,
        prefill_attention,
        prefill_tile_smem_bytes,
    )

    def tiles(profile_id: str) -> set[tuple]:
        q = torch.zeros(3, 8, 128, dtype=torch.float16)
        cache = torch.zeros(2, 6, 16, 2, 128, dtype=torch.float16)
        with collected_launches(get_profile(profile_id)) as specs:
            prefill_attention(q, cache, torch.zeros(3, 2, dtype=torch.int32),
                              torch.tensor([5, 20, 9], dtype=torch.int32),
                              torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.empty_like(q),
                              num_seqs=3, max_query_len=2, scale=0.1)
        assert all(spec.kind == AUTOTUNED for spec in specs)
        return {(dict(s.constexprs)["BLOCK_M"], dict(s.constexprs)["BLOCK_N"],
                 dict(s.options)["num_warps"], dict(s.options)["num_stages"]) for s in specs}

    a10, h100 = tiles("a10"), tiles("h100")
    assert a10 < h100 == set(PREFILL_CONFIGS)
    limit = get_profile("a10").shared_memory_per_block_bytes
    assert all(prefill_tile_smem_bytes(m, n, st, 128, 2) <= limit for m, n, _, st in a10)


def test_limits_of_a_compiled_kernel():
    t4 = get_profile("t4")
    assert limit_violation(t4, 64 * 1024, 128, 4) is None
    assert limit_violation(t4, 64 * 1024 + 1, 128, 4) == (64 * 1024 + 1, 64 * 1024,
                                                         "shared memory")
    assert limit_violation(t4, 1024, 255, 8) is None                  # 65,280 registers
    assert limit_violation(t4, 1024, 255, 16) == (255 * 512, 64 * 1024, "registers")
    assert limit_violation(get_profile("mi300x"), 1024, 512, 16) is None   # unknown: not held


def test_emulation_is_refused_without_a_gpu(fresh_process):
    """This machine has no GPU (detect() is the real one): emulation says so, and leaves
    Triton's target alone."""
    with pytest.raises(EmulationRefused, match="no GPU here to emulate t4"):
        emulate("t4")
    assert emulation.TRITON_ARCH_ENV not in os.environ
    assert emulation.emulated_profile() is None
    with pytest.raises(ValueError, match="unknown device profile 'k80'"):
        emulate("k80")


def test_an_engine_on_the_cpu_refuses_emulation(fresh_process, tiny_checkpoint):
    from archserve import LLM
    from archserve.engine.config import EngineConfig

    with pytest.raises(EmulationRefused, match="emulation runs on a GPU, and this engine runs "
                                               "on cpu"):
        LLM(tiny_checkpoint("llama"), device="cpu", emulate_device="t4")
    with pytest.raises(ValueError, match="unknown device profile"):
        EngineConfig(emulate_device="k80").validate()


def test_a_process_keeps_the_emulation_of_its_first_gpu_engine(fresh_process, monkeypatch):
    monkeypatch.setattr(emulation, "_fixed", "t4")
    with pytest.raises(EmulationRefused, match="already started a GPU engine with "
                                               "--emulate-device t4"):
        emulate(None)
    with pytest.raises(EmulationRefused, match="cannot start one with --emulate-device a100"):
        emulate("a100")
    monkeypatch.setattr(emulation, "_fixed", "native")
    with pytest.raises(EmulationRefused, match="with no emulation, so it cannot start one "
                                               "with --emulate-device t4"):
        emulate("t4")


def test_doctor_says_it_runs_emulated():
    from archserve.routing.doctor import run_doctor

    report = run_doctor(get_profile("h200"), emulate="t4")
    assert report.device.emulated_on == get_profile("h200") and report.can_run
    assert report.decisions[0].what == "device" and "emulated on NVIDIA H200" in \
        report.decisions[0].chosen
    assert report.decisions[1].chosen == "float16"
    assert report.to_dict()["device"]["emulated_on"]["id"] == "h200"
    assert report.ops["attention"].route.backend == "TRITON_ATTN"
    refused = run_doctor(get_profile("h200"), emulate="b200")
    assert not refused.can_run and "cannot emulate b200: b200 is SM100" in refused.blockers[0]
