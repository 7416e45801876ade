"""Feature flags per profile against seed 000 section 5.3 (data-type rows) and section 1."""

import pytest

from archserve.platform.device import features_for, rocm_fp8_for
from archserve.platform.profiles import get_profile

# Columns of the seed's matrix: SM70 SM75 SM80 SM89 SM90 SM100 SM120 SM121.
SEED_COLUMNS = ("v100", "t4", "a100", "l40s", "h100", "b200", "rtx5090", "gb10")
SEED_ROWS = {
    "fp32": (1, 1, 1, 1, 1, 1, 1, 1),
    "fp16": (1, 1, 1, 1, 1, 1, 1, 1),
    "bf16": (0, 0, 1, 1, 1, 1, 1, 1),
    "fp8_e4m3": (0, 0, 0, 1, 1, 1, 1, 1),
    "nvfp4": (0, 0, 0, 0, 0, 1, 1, 1),
    # The seed marks SM120/SM121 as "x(?)": we say no.
    "mxfp8": (0, 0, 0, 0, 0, 1, 0, 0),
}


@pytest.mark.parametrize("feature", SEED_ROWS)
def test_data_type_rows_match_the_seed(feature):
    got = tuple(int(getattr(get_profile(pid).features, feature)) for pid in SEED_COLUMNS)
    assert got == SEED_ROWS[feature]


@pytest.mark.parametrize("profile_id, expected", [
    ("a10", {"bf16": True, "fp8": False, "int8_tensor_cores": True}),
    ("rtx4090", {"fp8": True, "tma": False, "wgmma": False}),
    ("b300", {"nvfp4": True, "mxfp8": True, "tcgen05": True, "wgmma": False}),
    ("rtx5070-laptop", {"nvfp4": True, "mxfp8": False, "tcgen05": False, "tma": True}),
    ("h200", {"wgmma": True, "tma": True, "tcgen05": False}),
])
def test_architecture_features_of_the_other_profiles(profile_id, expected):
    features = get_profile(profile_id).features
    for name, value in expected.items():
        assert getattr(features, name) is value, (profile_id, name)


def test_volta_has_tensor_cores_but_no_int8_tensor_cores():
    features = get_profile("v100").features
    assert features.tensor_cores and not features.int8_tensor_cores
    assert get_profile("t4").features.int8_tensor_cores


def test_rocm_fp8_depends_on_the_gfx_target():
    assert rocm_fp8_for("gfx942:sramecc+:xnack-")
    assert not rocm_fp8_for("gfx90a")
    assert not rocm_fp8_for(None)
    assert features_for("rocm", None, rocm_fp8=rocm_fp8_for("gfx942")).fp8
    assert not features_for("rocm", None, rocm_fp8=rocm_fp8_for("gfx90a")).fp8


def test_cpu_has_no_gpu_features():
    features = get_profile("cpu").features
    assert features.bf16
    assert not (features.fp8 or features.tensor_cores or features.cuda_graphs)
