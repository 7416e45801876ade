"""Profiles: every id and alias resolves, and each carries its real capability."""

import pytest

from archserve.platform.capability import (
    SM61,
    SM70,
    SM75,
    SM80,
    SM86,
    SM89,
    SM90,
    SM100,
    SM103,
    SM110,
    SM120,
    SM121,
)
from archserve.platform.detect import resolve_device
from archserve.platform.profiles import (
    ALIASES,
    PROFILE_IDS,
    all_profiles,
    get_profile,
)

EXPECTED_IDS = ("p40", "v100", "t4", "a100", "a10", "l40s", "rtx4090", "h100", "h200", "b200", "b300",
                "thor", "rtx5090", "rtx5070-laptop", "gb10", "mi300x", "cpu")

EXPECTED_CAPABILITY = {
    "p40": SM61, "v100": SM70, "t4": SM75, "a100": SM80, "a10": SM86, "l40s": SM89, "rtx4090": SM89,
    "h100": SM90, "h200": SM90, "b200": SM100, "b300": SM103, "thor": SM110, "rtx5090": SM120,
    "rtx5070-laptop": SM120, "gb10": SM121, "mi300x": None, "cpu": None,
}


def test_profile_ids_are_exactly_the_agreed_set():
    assert PROFILE_IDS == EXPECTED_IDS
    assert [d.id for d in all_profiles()] == list(EXPECTED_IDS)


@pytest.mark.parametrize("profile_id", EXPECTED_IDS)
def test_every_profile_resolves_with_its_real_capability(profile_id):
    device = get_profile(profile_id)
    assert device.id == profile_id
    assert device.capability == EXPECTED_CAPABILITY[profile_id]
    assert device.memory_bytes > 4 * 1024**3
    assert device.memory_bandwidth_bytes_per_s and device.memory_bandwidth_bytes_per_s > 1e10
    if device.is_gpu:
        # Jetson Thor is the smallest: 20 SMs.
        assert device.multiprocessor_count and device.multiprocessor_count >= 20
        assert device.shared_memory_per_block_bytes >= 48 * 1024
        assert device.toolchain.torch_has_cuda
        assert device.toolchain.torch_version.startswith("2.11")
        assert device.toolchain.library("triton")


def test_aliases_map_to_representative_profiles():
    assert ALIASES == {
        "sm61": "p40", "sm70": "v100", "sm75": "t4", "sm80": "a100", "sm86": "a10", "sm89": "l40s",
        "sm90": "h100", "sm100": "b200", "sm103": "b300", "sm110": "thor",
        "sm120": "rtx5090", "sm121": "gb10",
    }
    for alias, target in ALIASES.items():
        assert get_profile(alias) is get_profile(target)
        assert str(get_profile(alias).capability).lower() == alias


def test_lookup_is_case_insensitive_and_unknown_ids_list_the_valid_ones():
    assert get_profile("H200").id == "h200"
    assert get_profile(" SM90 ").id == "h100"
    with pytest.raises(ValueError) as err:
        get_profile("rtx9090")
    assert "rtx9090" in str(err.value)
    for pid in EXPECTED_IDS:
        assert pid in str(err.value)


def test_mi300x_is_rocm_gfx942_with_fp8():
    device = get_profile("mi300x")
    assert device.platform == "rocm"
    assert device.gcn_arch == "gfx942"
    assert device.features.fp8
    assert "gfx942" in device.toolchain.torch_arch_list


def test_cuda_profiles_use_cuda13_except_volta():
    for device in all_profiles():
        if not device.is_cuda:
            continue
        expected = "12.6" if device.capability < SM75 else "13.0"
        assert device.toolchain.runtime_version == expected, device.id


def test_flash_attention_3_is_recorded_only_on_hopper_profiles():
    with_fa3 = {d.id for d in all_profiles() if d.toolchain.library("flash_attn_interface")}
    assert with_fa3 == {"h100", "h200"}


def test_resolve_device_uses_profiles_for_ids():
    assert resolve_device("b300").capability == SM103
    assert resolve_device("sm121").id == "gb10"


def test_every_profile_records_every_known_kernel_library():
    from archserve.platform.toolchain import KERNEL_LIBRARIES

    for device in all_profiles():
        assert set(device.toolchain.libraries) == set(KERNEL_LIBRARIES), device.id
