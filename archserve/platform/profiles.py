"""Named device profiles: real GPUs described well enough to simulate them.

A profile is a `DeviceInfo` for a device that is not here, so `explain`, `matrix`
and tests can ask "what would archserve do on a B200?" on any machine. Each
profile carries its real capability and a plausible, *healthy* toolchain: a torch
build whose arch list covers the device, a driver new enough for its runtime, and
the optional kernel libraries a user of that GPU would have installed. Which
libraries selection may assume is decided by selection (the registry's library
assumption), not here.

Feature flags are never typed here: they come from `features_for`, the one rule.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    Capability,
)
from archserve.platform.device import (
    CUDA_REGISTERS_PER_BLOCK,
    DeviceInfo,
    Toolchain,
    features_for,
    rocm_fp8_for,
)
from archserve.platform.toolchain import TORCH_WHEELS

GiB = 1024**3
MiB = 1024**2
GB_PER_S = 1e9

# Shared memory values are the opt-in maximum per block, i.e. what a kernel
# (Triton, FlashAttention) can actually ask for; it is what tile-size rules read.
_SMEM_SM61 = 48 * 1024
_SMEM_SM70 = 96 * 1024
_SMEM_SM75 = 64 * 1024
_SMEM_SM80 = 163 * 1024
_SMEM_SM8X_CONSUMER = 99 * 1024      # SM86 / SM89 / SM120 / SM121
_SMEM_SM90_SM100 = 227 * 1024
_LDS_CDNA3 = 64 * 1024

# Torch 2.11 wheels (see `TORCH_WHEELS`). cu130 has no Volta (CUDA 13 dropped SM70);
# SM103 and SM121 run the sm_100 / sm_120 cubins by same-major minor compatibility.
TORCH_VERSION = "2.11.0"
_WHEELS = {wheel.tag: wheel for wheel in TORCH_WHEELS}
ROCM7_ARCH_LIST = ("gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx950",
                   "gfx1030", "gfx1100", "gfx1101", "gfx1200", "gfx1201")

_DRIVER_CUDA13 = ("580.95.05", "13.0")
_DRIVER_CUDA12 = ("570.195.03", "12.8")


# Jetson Thor (SM110) is not in the PyPI wheels' arch lists: its users install NVIDIA's
# JetPack 7 (CUDA 13) torch build, which ships sm_110 code.
_JETSON_THOR_ARCH_LIST = ("sm_87", "sm_110")


def _cuda_toolchain(cap: Capability) -> Toolchain:
    """The toolchain a well-set-up user of a CUDA device of this capability has."""
    if cap < SM75:   # Volta: the newest wheels that still ship sm_70 are CUDA 12.x
        wheel, (driver, driver_cuda) = _WHEELS["cu126"], _DRIVER_CUDA12
    else:
        wheel, (driver, driver_cuda) = _WHEELS["cu130"], _DRIVER_CUDA13
    arch_list, tag = wheel.arch_list, wheel.tag
    if cap.family == 110:
        arch_list, tag = _JETSON_THOR_ARCH_LIST, "jetpack7"
    libraries: dict[str, str | None] = {
        "triton": "3.7.0",
        "flash_attn": "2.8.3" if cap >= SM80 else None,
        "vllm_flash_attn": "2.7.4" if cap >= SM80 else None,
        # FA3 is built for Hopper only.
        "flash_attn_interface": "3.0.0" if cap.family == 90 else None,
        "flashinfer": "0.5.2" if SM75 <= cap <= SM121 else None,
        "deep_gemm": "2.1.0" if cap.family in (90, 100) else None,
    }
    return Toolchain(
        torch_version=f"{TORCH_VERSION}+{tag}",
        driver_version=driver,
        driver_cuda_version=driver_cuda,
        runtime_version=wheel.cuda,
        torch_arch_list=arch_list,
        torch_has_cuda=True,
        libraries=libraries,
    )


@dataclass(frozen=True)
class _CudaSpec:
    name: str
    capability: Capability
    memory_bytes: int
    bandwidth_gb_per_s: float
    sm_count: int
    smem_per_block: int


_CUDA_SPECS: dict[str, _CudaSpec] = {
    # Pascal: no tensor cores, fp16 at 1/64 rate; the cu126 wheels still ship sm_60 code.
    "p40": _CudaSpec("Tesla P40", SM61, 22919 * MiB, 346, 30, _SMEM_SM61),
    "v100": _CudaSpec("Tesla V100-SXM2-32GB", SM70, 32 * GiB, 900, 80, _SMEM_SM70),
    "t4": _CudaSpec("Tesla T4", SM75, 15360 * MiB, 320, 40, _SMEM_SM75),
    "a100": _CudaSpec("NVIDIA A100-SXM4-80GB", SM80, 81920 * MiB, 2039, 108, _SMEM_SM80),
    "a10": _CudaSpec("NVIDIA A10", SM86, 23028 * MiB, 600, 72, _SMEM_SM8X_CONSUMER),
    "l40s": _CudaSpec("NVIDIA L40S", SM89, 46068 * MiB, 864, 142, _SMEM_SM8X_CONSUMER),
    "rtx4090": _CudaSpec("NVIDIA GeForce RTX 4090", SM89, 24564 * MiB, 1008, 128,
                         _SMEM_SM8X_CONSUMER),
    "h100": _CudaSpec("NVIDIA H100 80GB HBM3", SM90, 81559 * MiB, 3352, 132, _SMEM_SM90_SM100),
    # Memory, SMs and shared memory as a live H200 reports them through torch.
    "h200": _CudaSpec("NVIDIA H200", SM90, 150_109_880_320, 4800, 132, _SMEM_SM90_SM100),
    "b200": _CudaSpec("NVIDIA B200", SM100, 183359 * MiB, 8000, 148, _SMEM_SM90_SM100),
    "b300": _CudaSpec("NVIDIA B300 SXM6 AC", SM103, 275040 * MiB, 8000, 148, _SMEM_SM90_SM100),
    # Jetson AGX Thor: 20 SMs sharing 128 GB of LPDDR5X with the Arm CPU (273 GB/s).
    "thor": _CudaSpec("NVIDIA Thor", SM110, 125772 * MiB, 273, 20, _SMEM_SM90_SM100),
    "rtx5090": _CudaSpec("NVIDIA GeForce RTX 5090", SM120, 32607 * MiB, 1792, 170,
                         _SMEM_SM8X_CONSUMER),
    "rtx5070-laptop": _CudaSpec("NVIDIA GeForce RTX 5070 Laptop GPU", SM120, 8151 * MiB, 384, 36,
                                _SMEM_SM8X_CONSUMER),
    # GB10 shares LPDDR5X with its Arm CPU; torch reports most of the 128 GB.
    "gb10": _CudaSpec("NVIDIA GB10", SM121, 122502 * MiB, 273, 48, _SMEM_SM8X_CONSUMER),
}


def _cuda_profile(profile_id: str, spec: _CudaSpec) -> DeviceInfo:
    return DeviceInfo(
        id=profile_id,
        platform="cuda",
        name=spec.name,
        capability=spec.capability,
        memory_bytes=spec.memory_bytes,
        features=features_for("cuda", spec.capability),
        toolchain=_cuda_toolchain(spec.capability),
        memory_bandwidth_bytes_per_s=spec.bandwidth_gb_per_s * GB_PER_S,
        multiprocessor_count=spec.sm_count,
        shared_memory_per_block_bytes=spec.smem_per_block,
        nvidia_gpu_present=True,
        registers_per_block=CUDA_REGISTERS_PER_BLOCK,
    )


def _mi300x() -> DeviceInfo:
    # ROCm devices have no SM capability: rules read gcn_arch and the feature flags.
    gcn_arch = "gfx942"
    return DeviceInfo(
        id="mi300x",
        platform="rocm",
        name="AMD Instinct MI300X",
        capability=None,
        memory_bytes=192 * GiB,
        features=features_for("rocm", None, rocm_fp8=rocm_fp8_for(gcn_arch)),
        toolchain=Toolchain(
            torch_version=f"{TORCH_VERSION}+rocm7.0",
            driver_version="6.14.14",        # amdgpu kernel driver shipped with ROCm 7.0
            driver_cuda_version=None,
            runtime_version="7.0",
            torch_arch_list=ROCM7_ARCH_LIST,
            torch_has_cuda=True,              # torch's GPU build (HIP) is present
            libraries={"triton": "3.7.0", "flash_attn": None, "vllm_flash_attn": None,
                       "flash_attn_interface": None, "flashinfer": None, "deep_gemm": None},
        ),
        memory_bandwidth_bytes_per_s=5300 * GB_PER_S,
        multiprocessor_count=304,
        shared_memory_per_block_bytes=_LDS_CDNA3,
        gcn_arch=gcn_arch,
    )


_SERVER_CPU_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                               "avx512_vnni", "avx512_bf16"})


def _cpu() -> DeviceInfo:
    return DeviceInfo(
        id="cpu",
        platform="cpu",
        name="x86-64 CPU with AVX-512 BF16 (simulated)",
        capability=None,
        memory_bytes=64 * GiB,
        # A current server CPU (Zen 4, Sapphire Rapids without its AMX).
        features=features_for("cpu", None, cpu_flags=_SERVER_CPU_FLAGS),
        toolchain=Toolchain(
            torch_version=f"{TORCH_VERSION}+cpu",
            torch_has_cuda=False,
            libraries={"triton": None, "flash_attn": None, "vllm_flash_attn": None,
                       "flash_attn_interface": None, "flashinfer": None, "deep_gemm": None},
        ),
        memory_bandwidth_bytes_per_s=100 * GB_PER_S,
    )


def _build_profiles() -> dict[str, DeviceInfo]:
    profiles = {pid: _cuda_profile(pid, spec) for pid, spec in _CUDA_SPECS.items()}
    profiles["mi300x"] = _mi300x()
    profiles["cpu"] = _cpu()
    return profiles


_PROFILES: dict[str, DeviceInfo] = _build_profiles()

PROFILE_IDS: tuple[str, ...] = (
    "p40", "v100", "t4", "a100", "a10", "l40s", "rtx4090", "h100", "h200", "b200", "b300", "thor",
    "rtx5090", "rtx5070-laptop", "gb10", "mi300x", "cpu",
)

# One representative profile per SM, so "--device sm90" works without naming a GPU.
ALIASES: dict[str, str] = {
    "sm61": "p40", "sm70": "v100", "sm75": "t4", "sm80": "a100", "sm86": "a10", "sm89": "l40s",
    "sm90": "h100", "sm100": "b200", "sm103": "b300", "sm110": "thor", "sm120": "rtx5090", "sm121": "gb10",
}

assert set(PROFILE_IDS) == set(_PROFILES), "PROFILE_IDS and the profile table disagree"


def get_profile(id_or_alias: str) -> DeviceInfo:
    """The profile for an id or SM alias, case-insensitively (``"H200"``, ``"sm90"``)."""
    key = id_or_alias.strip().lower()
    key = ALIASES.get(key, key)
    if key not in _PROFILES:
        valid = ", ".join(PROFILE_IDS)
        aliases = ", ".join(ALIASES)
        raise ValueError(f"unknown device profile {id_or_alias!r}; valid ids: {valid}; "
                         f"aliases: {aliases}")
    return _PROFILES[key]


def all_profiles() -> list[DeviceInfo]:
    """Every profile, in PROFILE_IDS order."""
    return [_PROFILES[pid] for pid in PROFILE_IDS]
