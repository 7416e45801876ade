"""detect() on this machine, and the pieces it is made of."""

import os
import sys
from types import SimpleNamespace

import pytest

from archserve.platform.detect import (
    detect,
    library_versions,
    memory_bandwidth_from_props,
    nvidia_gpu_present,
)
from archserve.platform.toolchain import KERNEL_LIBRARIES, arch_verdict

torch = pytest.importorskip("torch")
ON_CPU = not torch.cuda.is_available()


@pytest.mark.skipif(not ON_CPU, reason="this machine has an accelerator")
def test_detect_on_a_cpu_machine_returns_a_sane_cpu_device():
    device = detect(refresh=True)
    assert device.id == "live"
    assert device.platform == "cpu"
    assert device.capability is None
    assert device.name.strip()
    page = os.sysconf("SC_PAGE_SIZE")
    assert device.memory_bytes == page * os.sysconf("SC_PHYS_PAGES")
    assert device.memory_bytes > 256 * 1024**2
    assert not device.features.tensor_cores
    tc = device.toolchain
    assert tc.torch_version == str(torch.__version__)
    assert tc.torch_has_cuda is bool(torch.version.cuda)
    assert tc.torch_arch_list == tuple(torch.cuda.get_arch_list())
    assert tc.runtime_version == torch.version.cuda
    assert device.nvidia_gpu_present == nvidia_gpu_present()


def test_detect_is_cached_until_refreshed():
    assert detect() is detect()
    first = detect()
    assert detect(refresh=True) == first


def test_library_versions_cover_every_kernel_library_and_match_metadata():
    import importlib.metadata

    versions = library_versions()
    assert set(versions) == set(KERNEL_LIBRARIES)
    try:
        expected_triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        expected_triton = None
    if expected_triton is not None:
        assert versions["triton"] == expected_triton
    for module, version in versions.items():
        assert version is None or version[0].isdigit(), module


def test_library_detection_does_not_import_the_libraries():
    before = set(sys.modules)
    library_versions()
    imported = {m for m in set(sys.modules) - before if m.split(".")[0] in KERNEL_LIBRARIES}
    assert imported == set()


def test_bandwidth_is_double_data_rate_clock_times_bus_width():
    h100_like = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    assert memory_bandwidth_from_props(h100_like) == pytest.approx(3.352e12, rel=1e-3)
    assert memory_bandwidth_from_props(SimpleNamespace(memory_clock_rate=0,
                                                       memory_bus_width=5120)) is None
    assert memory_bandwidth_from_props(SimpleNamespace()) is None


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="needs a GPU")
def test_detect_on_a_gpu_reports_its_capability_and_toolchain():
    device = detect(refresh=True)
    assert device.is_gpu
    props = torch.cuda.get_device_properties(0)
    assert device.name == props.name
    assert device.memory_bytes == props.total_memory
    if device.is_cuda:
        assert (device.capability.major, device.capability.minor) == (props.major, props.minor)
        assert device.nvidia_gpu_present
        assert device.toolchain.torch_has_cuda
        assert arch_verdict(device)[0], arch_verdict(device)[1]
        assert device.toolchain.runtime_version == torch.version.cuda
        assert device.shared_memory_per_block_bytes >= 48 * 1024
