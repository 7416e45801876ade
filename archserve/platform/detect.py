"""detect(): the device this process computes on and its toolchain, as a `DeviceInfo`.

Order: a CUDA or ROCm GPU through torch, then an Intel XPU, else the CPU. The
driver comes from NVML (`nvidia-ml-py`, module `pynvml`) when it is installed.
Whether an NVIDIA GPU exists is also asked of the OS, so a CPU-only torch on a GPU
machine can be diagnosed. Nothing here raises: an unanswerable question becomes
None (unknown) in the result.

Under emulation (platform/emulation.py) the device is the live one narrowed to a
profile's capabilities; everything that asks ``detect()`` or ``device_info_for`` gets
that device, and nothing else needs to know. ``detect_present()`` is the silicon.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import platform as host_platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from archserve.platform.capability import Capability
from archserve.platform.device import (
    CUDA_REGISTERS_PER_BLOCK,
    DeviceInfo,
    Toolchain,
    features_for,
    rocm_fp8_for,
)
from archserve.platform.profiles import get_profile
from archserve.platform.toolchain import KERNEL_LIBRARIES

log = logging.getLogger(__name__)

NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
NVIDIA_SMI_TIMEOUT_S = 3.0

# Distributions that ship a kernel library module under another name than its own.
_EXTRA_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "triton": ("pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"),
    "flash_attn_interface": ("flash_attn_3", "flash-attn-hopper"),
}


# The device that stands in for the live one (platform/emulation.py sets it), and whether
# it stands in for CPU tensors too (a compile target on a machine without that GPU).
_standing_in: DeviceInfo | None = None
_for_every_tensor = False


def detect(*, refresh: bool = False) -> DeviceInfo:
    """The device this process computes on (cached; ``refresh`` asks again): the live
    device, or under emulation the live device narrowed to the emulated profile."""
    if _standing_in is not None:
        return _standing_in
    return detect_present(refresh=refresh)


def detect_present(*, refresh: bool = False) -> DeviceInfo:
    """The silicon and toolchain here, whatever is emulated."""
    if refresh:
        _detect_cached.cache_clear()
    return _detect_cached()


def device_info_for(torch_device: Any) -> DeviceInfo:
    """The DeviceInfo of the device a tensor lives on: ``detect()`` for a GPU tensor, the
    CPU profile for a CPU tensor on a GPU host. Every question a kernel wrapper asks of
    its GPU (capability, shared memory, SMs) is asked here, so emulation answers it."""
    if _standing_in is not None and _for_every_tensor:
        return _standing_in
    device_type = getattr(torch_device, "type", None) or str(torch_device).split(":")[0]
    info = detect()
    if device_type == "cpu" and info.platform != "cpu":
        return get_profile("cpu")
    return info


def resolve_device(id_or_live: str | None) -> DeviceInfo:
    """``None`` or ``"live"``: the device here (`detect`); anything else: a profile."""
    if id_or_live is None or id_or_live.strip().lower() == "live":
        return detect()
    return get_profile(id_or_live)


def standing_in() -> tuple[DeviceInfo | None, bool]:
    """(the device standing in for the live one, whether for CPU tensors too)."""
    return _standing_in, _for_every_tensor


def set_standing_in(device: DeviceInfo | None, *, for_every_tensor: bool = False) -> None:
    """Make ``device`` what ``detect()`` answers (None: the live device again); with
    ``for_every_tensor`` also what ``device_info_for`` answers for CPU tensors. Called by
    platform/emulation.py only."""
    global _standing_in, _for_every_tensor
    _standing_in, _for_every_tensor = device, for_every_tensor


@functools.cache
def _detect_cached() -> DeviceInfo:
    import torch

    driver_version, driver_cuda = nvml_driver_versions()
    toolchain = Toolchain(
        torch_version=str(torch.__version__),
        driver_version=driver_version,
        driver_cuda_version=driver_cuda,
        runtime_version=torch.version.cuda or getattr(torch.version, "hip", None),
        torch_arch_list=tuple(_safe(torch.cuda.get_arch_list, [])),
        torch_has_cuda=bool(torch.version.cuda or getattr(torch.version, "hip", None)),
        libraries=library_versions(),
    )
    gpu_present = nvidia_gpu_present()
    if _safe(torch.cuda.is_available, False):
        return _cuda_or_rocm_device(torch, toolchain, gpu_present)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and _safe(xpu.is_available, False):
        return _xpu_device(xpu, toolchain, gpu_present)
    return cpu_device(toolchain, gpu_present)


def _safe(fn: Any, default: Any) -> Any:
    """Call a probing function; any failure means "unknown", never a crash."""
    try:
        return fn()
    except Exception as exc:  # a probe must never take the process down
        log.debug("probe %s failed: %s", getattr(fn, "__name__", fn), exc)
        return default


def _cuda_or_rocm_device(torch: Any, toolchain: Toolchain, gpu_present: bool) -> DeviceInfo:
    props = torch.cuda.get_device_properties(0)
    is_rocm = bool(getattr(torch.version, "hip", None))
    gcn_arch = getattr(props, "gcnArchName", None) if is_rocm else None
    # ROCm reports the gfx version as (major, minor); it is not an SM and must not
    # satisfy SM rules, so ROCm devices carry capability None and their gcn_arch.
    capability = None if is_rocm else Capability(props.major, props.minor)
    platform = "rocm" if is_rocm else "cuda"
    return DeviceInfo(
        id="live",
        platform=platform,
        name=props.name,
        capability=capability,
        memory_bytes=int(props.total_memory),
        features=features_for(platform, capability, rocm_fp8=rocm_fp8_for(gcn_arch)),
        toolchain=toolchain,
        memory_bandwidth_bytes_per_s=memory_bandwidth_from_props(props),
        multiprocessor_count=int(props.multi_processor_count),
        shared_memory_per_block_bytes=shared_memory_per_block(props),
        gcn_arch=gcn_arch,
        nvidia_gpu_present=gpu_present or not is_rocm,
        registers_per_block=None if is_rocm else CUDA_REGISTERS_PER_BLOCK,
    )


def memory_bandwidth_from_props(props: Any) -> float | None:
    """Peak DRAM bandwidth = 2 (double data rate) x memory clock x bus width, when torch
    exposes both (CUDA 13 may report a clock of 0: then unknown)."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz <= 0 or bus_bits <= 0:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def shared_memory_per_block(props: Any) -> int | None:
    """The shared memory one block may use on a device of these torch properties: the
    opt-in maximum (older torch only has the default 48 KiB); None if torch says neither."""
    for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
        value = getattr(props, name, None)
        if value:
            return int(value)
    return None


def _xpu_device(xpu: Any, toolchain: Toolchain, gpu_present: bool) -> DeviceInfo:
    props = xpu.get_device_properties(0)
    return DeviceInfo(
        id="live",
        platform="xpu",
        name=str(props.name),
        capability=None,
        memory_bytes=int(props.total_memory),
        features=features_for("xpu", None),
        toolchain=toolchain,
        multiprocessor_count=getattr(props, "gpu_subslice_count", None),
        nvidia_gpu_present=gpu_present,
    )


def cpu_device(toolchain: Toolchain, gpu_present: bool = False) -> DeviceInfo:
    """The host CPU as a device."""
    return DeviceInfo(
        id="live",
        platform="cpu",
        name=cpu_name(),
        capability=None,
        memory_bytes=host_memory_bytes(),
        features=features_for("cpu", None, cpu_flags=cpu_flags()),
        toolchain=toolchain,
        nvidia_gpu_present=gpu_present,
    )


# torch's dispatch level (torch.backends.cpu.get_cpu_capability) -> the flags it implies,
# for a host without /proc/cpuinfo.
_TORCH_CPU_LEVEL_FLAGS = {
    "AVX2": ("avx2", "fma"),
    "AVX512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
}


def cpu_flags() -> frozenset[str]:
    """The host CPU's ISA flags: /proc/cpuinfo's first "flags" line, else what torch's
    dispatch level implies (then VNNI, BF16 and AMX are unknown: absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch
    level = _safe(torch.backends.cpu.get_cpu_capability, "DEFAULT")
    return frozenset(_TORCH_CPU_LEVEL_FLAGS.get(level, ()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host_platform.processor() or host_platform.machine() or "CPU"


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


# --- NVIDIA driver ------------------------------------------------------------------


def nvml_driver_versions() -> tuple[str | None, str | None]:
    """(driver version, newest CUDA it supports) from NVML, or (None, None)."""
    if importlib.util.find_spec("pynvml") is None:
        return None, None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no driver, or no permission
        log.debug("NVML unavailable: %s", exc)
        return None, None
    try:
        driver = _text(_safe(pynvml.nvmlSystemGetDriverVersion, None))
        cuda_int = _safe(pynvml.nvmlSystemGetCudaDriverVersion_v2, None)
        cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}" if cuda_int else None
        return driver, cuda
    finally:
        _safe(pynvml.nvmlShutdown, None)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def nvidia_gpu_present() -> bool:
    """Whether the OS sees an NVIDIA GPU, whatever torch was built for."""
    try:
        if NVIDIA_PROC_GPUS.is_dir() and any(NVIDIA_PROC_GPUS.iterdir()):
            return True
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True,
                                 timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return listing.returncode == 0 and "GPU " in listing.stdout


# --- optional kernel libraries ------------------------------------------------------


def library_versions() -> dict[str, str | None]:
    """Version of each optional kernel library by import name (None: absent), read from
    installed package metadata so no heavy module is imported."""
    module_to_dists = _safe(importlib.metadata.packages_distributions, {})
    versions: dict[str, str | None] = {}
    for module, lib in KERNEL_LIBRARIES.items():
        candidates = (*module_to_dists.get(module, ()), lib.distribution,
                      *_EXTRA_DISTRIBUTIONS.get(module, ()))
        versions[module] = _first_version(candidates)
    if versions.get("vllm_flash_attn") is None:
        versions["vllm_flash_attn"] = _vllm_bundled_flash_attn()
    return versions


def _first_version(distributions: tuple[str, ...]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _vllm_bundled_flash_attn() -> str | None:
    """vLLM ships its flash-attention fork inside the vllm package; finding the folder
    avoids importing vllm itself."""
    spec = _safe(lambda: importlib.util.find_spec("vllm"), None)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "vllm_flash_attn").is_dir():
            return _first_version(("vllm",))
    return None


__all__ = ["cpu_device", "detect", "detect_present", "device_info_for", "library_versions",
           "memory_bandwidth_from_props", "nvidia_gpu_present", "nvml_driver_versions"]
