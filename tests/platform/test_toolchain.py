"""Toolchain diagnosis by simulation: profiles with a deliberately broken toolchain."""

from dataclasses import replace

import pytest

from archserve.platform.capability import SM80, SM86, SM90, SM100, SM103, SM120, SM121
from archserve.platform.profiles import PROFILE_IDS, get_profile
from archserve.platform.toolchain import (
    arch_entry_runs_on,
    arch_verdict,
    covering_arch,
    diagnose,
    driver_max_cuda,
    min_driver_for,
    suggest_torch_wheel,
    three_layer_verdict,
)

CU124_ARCH_LIST = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


def with_toolchain(profile_id, **changes):
    device = get_profile(profile_id)
    return replace(device, toolchain=replace(device.toolchain, **changes))


def codes(device):
    return [f.code for f in diagnose(device)]


@pytest.mark.parametrize("profile_id", PROFILE_IDS)
def test_every_profile_is_a_healthy_install(profile_id):
    device = get_profile(profile_id)
    assert diagnose(device) == []
    ok, text = three_layer_verdict(device)
    assert ok, text
    assert arch_verdict(device)[0]


# --- arch coverage rules ----------------------------------------------------------------


@pytest.mark.parametrize("entry, cap, runs", [
    ("sm_80", SM86, True),          # same major, newer minor
    ("sm_86", SM80, False),         # never backwards
    ("sm_90", SM100, False),        # cubins do not cross majors
    ("sm_100", SM103, True),
    ("sm_120", SM121, True),
    ("sm_100", SM120, False),       # SM100 and SM120 are different families
    ("sm_90a", SM90, True),
    ("sm_100a", SM103, False),      # arch-specific code does not forward-port
    ("sm_100f", SM103, True),       # family-specific code does, within the family
    ("compute_90", SM120, True),    # PTX JIT-compiles for anything newer
    ("compute_90", SM86, False),
    ("compute_90a", SM100, False),
    ("gfx942", SM90, False),
])
def test_arch_entry_runs_on(entry, cap, runs):
    assert arch_entry_runs_on(entry, cap) is runs


def test_covering_arch_prefers_native_code_over_ptx():
    assert covering_arch(SM90, ("sm_80", "sm_90", "compute_90")) == "sm_90"
    assert covering_arch(SM120, ("sm_80", "sm_90", "compute_90")) == "compute_90"
    assert covering_arch(SM120, CU124_ARCH_LIST) is None


# --- (a) arch_not_in_torch_build ----------------------------------------------------------


def test_rtx5090_with_a_cuda_12_4_torch_is_not_covered():
    device = with_toolchain("rtx5090", torch_version="2.5.1+cu124", runtime_version="12.4",
                            torch_arch_list=CU124_ARCH_LIST)
    findings = diagnose(device)
    assert [f.code for f in findings] == ["arch_not_in_torch_build"]
    finding = findings[0]
    assert finding.severity == "error"
    assert "sm_120" in finding.title
    assert "no kernel image" in finding.detail
    # The remedy names a wheel index that covers Blackwell and that the driver can run.
    assert "download.pytorch.org/whl/cu130" in finding.remedy
    assert not arch_verdict(device)[0]
    assert not three_layer_verdict(device)[0]


def test_ptx_in_the_build_makes_a_newer_gpu_work():
    device = with_toolchain("rtx5090", torch_arch_list=CU124_ARCH_LIST + ("compute_90",))
    assert "arch_not_in_torch_build" not in codes(device)
    ok, text = arch_verdict(device)
    assert ok and "compute_90" in text and "JIT" in text


def test_arch_specific_build_does_not_cover_a_later_minor():
    device = with_toolchain("b300", torch_arch_list=("sm_90a", "sm_100a"))
    assert codes(device) == ["arch_not_in_torch_build"]


def test_wheel_suggestion_respects_the_driver():
    wheel, driver_ok = suggest_torch_wheel(SM120, "12.8")
    assert (wheel.tag, driver_ok) == ("cu128", True)
    wheel, driver_ok = suggest_torch_wheel(SM120, "12.6")
    assert driver_ok is False and wheel.tag == "cu130"
    wheel, _ = suggest_torch_wheel(get_profile("v100").capability, "13.0")
    assert wheel.tag == "cu126"          # CUDA 12.8+ wheels no longer ship sm_70


def test_old_driver_makes_the_arch_remedy_mention_the_driver_upgrade():
    device = with_toolchain("rtx5090", torch_arch_list=CU124_ARCH_LIST, runtime_version="12.4",
                            driver_version="550.54.14", driver_cuda_version="12.4")
    finding = next(f for f in diagnose(device) if f.code == "arch_not_in_torch_build")
    assert "580.65.06" in finding.remedy and "whl/cu130" in finding.remedy


def test_rocm_build_without_the_gfx_target():
    device = with_toolchain("mi300x", torch_arch_list=("gfx90a", "gfx1100"))
    assert codes(device) == ["arch_not_in_torch_build"]


# --- (b) runtime_newer_than_driver -------------------------------------------------------


def test_cuda13_torch_on_a_cuda12_driver_is_an_error():
    device = with_toolchain("h100", driver_version="560.35.03", driver_cuda_version="12.6")
    findings = diagnose(device)
    assert [f.code for f in findings] == ["runtime_newer_than_driver"]
    finding = findings[0]
    assert finding.severity == "error"
    assert "580.65.06" in finding.remedy
    assert "whl/cu126" in finding.remedy      # an older build this driver can run
    assert not three_layer_verdict(device)[0]


def test_same_major_newer_minor_is_a_warning_through_minor_version_compatibility():
    device = with_toolchain("a100", runtime_version="12.8", driver_version="550.54.14",
                            driver_cuda_version="12.4",
                            torch_arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100"))
    findings = diagnose(device)
    assert [(f.code, f.severity) for f in findings] == [("runtime_newer_than_driver", "warning")]
    assert "570.26" in findings[0].remedy
    ok, text = three_layer_verdict(device)
    assert ok and "[warning]" in text


def test_driver_cuda_version_is_derived_from_the_driver_when_nvml_gave_none():
    device = with_toolchain("h100", driver_version="575.57.08", driver_cuda_version=None)
    assert driver_max_cuda(device) == "12.9"
    assert codes(device) == ["runtime_newer_than_driver"]
    assert codes(with_toolchain("h100", driver_version=None, driver_cuda_version=None)) == []


def test_min_driver_table():
    assert min_driver_for("12.8") == "570.26"
    assert min_driver_for("13.0") == "580.65.06"
    assert min_driver_for("12.7") == "560.28.03"     # unknown minor: newest lower bound


# --- (c) cpu_torch_with_nvidia_gpu -------------------------------------------------------


def test_cpu_torch_on_a_machine_with_an_nvidia_gpu():
    healthy_cpu = get_profile("cpu")
    device = replace(healthy_cpu, nvidia_gpu_present=True,
                     toolchain=replace(healthy_cpu.toolchain, driver_version="580.95.05",
                                       driver_cuda_version="13.0"))
    findings = diagnose(device)
    assert [f.code for f in findings] == ["cpu_torch_with_nvidia_gpu"]
    assert "--index-url https://download.pytorch.org/whl/cu130" in findings[0].remedy
    ok, text = three_layer_verdict(device)
    assert not ok and "CPU-only" in text


# --- (d) library_unusable ----------------------------------------------------------------


@pytest.mark.parametrize("profile_id, library, expected_in_detail", [
    ("t4", "flash_attn", "SM80"),
    ("cpu", "flash_attn", "NVIDIA GPU"),
    ("v100", "flashinfer", "SM75"),
    ("b200", "flash_attn_interface", "SM90"),
    ("rtx5090", "flash_attn_interface", "SM90"),
    ("mi300x", "flashinfer", "ROCm"),
])
def test_installed_library_that_cannot_run_here(profile_id, library, expected_in_detail):
    device = get_profile(profile_id)
    device = device.with_libraries({**device.toolchain.libraries, library: "9.9.9"})
    findings = diagnose(device)
    assert [f.code for f in findings] == ["library_unusable"]
    finding = findings[0]
    assert finding.severity == "warning"
    assert library in finding.title and "9.9.9" in finding.title
    assert expected_in_detail in finding.detail
    assert finding.remedy.startswith("nothing is broken")


def test_usable_libraries_are_not_reported():
    for profile_id, library in [("h100", "flash_attn_interface"), ("a100", "flash_attn"),
                                ("gb10", "flashinfer"), ("cpu", "triton"),
                                ("mi300x", "flash_attn")]:
        device = get_profile(profile_id)
        device = device.with_libraries({**device.toolchain.libraries, library: "1.0"})
        assert codes(device) == [], (profile_id, library)


def test_findings_are_sorted_errors_first():
    device = with_toolchain("t4", driver_version="560.35.03", driver_cuda_version="11.8",
                            libraries={"flash_attn": "2.8.3"})
    assert [f.severity for f in diagnose(device)] == ["error", "warning"]


def test_sm80_family_profiles_still_run_sm80_code():
    assert covering_arch(SM86, get_profile("a10").toolchain.torch_arch_list) == "sm_80"


def test_driver_too_old_for_cuda_torch_is_found_even_after_falling_back_to_cpu():
    # torch.cuda.is_available() is False when the driver is too old, so detect() reports
    # the CPU; the diagnosis must still name the driver.
    cpu = get_profile("cpu")
    device = replace(cpu, nvidia_gpu_present=True, toolchain=replace(
        get_profile("h100").toolchain, driver_version="535.183.01", driver_cuda_version="12.2",
        libraries={}))
    findings = diagnose(device)
    assert [(f.code, f.severity) for f in findings] == [("runtime_newer_than_driver", "error")]
    assert not three_layer_verdict(device)[0]
