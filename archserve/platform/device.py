"""DeviceInfo: what a device can do and what toolchain surrounds it.

Everything a selector needs is a field here, so a simulated profile and a live
device answer the same questions. Feature flags are derived from platform and
capability in one place (`features_for`), never typed per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from archserve.platform.capability import SM70, SM75, SM80, SM89, SM90, SM100, Capability

PLATFORMS = ("cuda", "rocm", "xpu", "cpu")
# 32-bit registers one thread block may hold: 64K on every NVIDIA GPU from Kepler to
# Blackwell (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
CUDA_REGISTERS_PER_BLOCK = 64 * 1024


@dataclass(frozen=True)
class Features:
    """Hardware features. Each flag means the silicon (and platform) supports it."""

    fp32: bool = True
    fp16: bool = True
    bf16: bool = False
    fp8_e4m3: bool = False
    fp8_e5m2: bool = False
    nvfp4: bool = False
    mxfp8: bool = False
    int8_tensor_cores: bool = False
    tensor_cores: bool = False
    cp_async: bool = False
    tma: bool = False
    wgmma: bool = False
    tcgen05: bool = False
    cuda_graphs: bool = False
    # A CPU's vector ISA (x86 flags as /proc/cpuinfo names them): which of torch's CPU
    # kernels run vectorised, and whether bfloat16 products are native.
    avx2: bool = False             # AVX2 + FMA: torch's int4/int8 weight-only kernels
    avx512: bool = False           # AVX-512 F/BW/VL: their wider paths
    avx512_vnni: bool = False      # int8 dot products
    avx512_bf16: bool = False      # bfloat16 dot products (vdpbf16ps)
    amx: bool = False              # AMX tiles (bf16 and int8 matrix units)

    @property
    def fp8(self) -> bool:
        return self.fp8_e4m3 and self.fp8_e5m2

    @property
    def cpu_bf16(self) -> bool:
        """A CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX); without either,
        oneDNN converts bfloat16 products in software (slower than float32 at prompt
        sizes: benchmarks/cpu_bf16_emulation.py)."""
        return self.avx512_bf16 or self.amx

    def cpu_isa(self) -> list[str]:
        """The CPU vector extensions present, as doctor and explain name them."""
        present = (self.avx2, self.avx512, self.avx512_vnni, self.avx512_bf16, self.amx)
        return [name for name, has in zip(ALL_CPU_ISA, present, strict=True) if has]


ALL_CPU_ISA = ("AVX2", "AVX-512", "AVX-512 VNNI", "AVX-512 BF16", "AMX")


# /proc/cpuinfo flags behind each CPU feature (every one listed must be present).
CPU_FEATURE_FLAGS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_int8", "amx_tile"),
}


def features_for(platform: str, capability: Capability | None, *, rocm_fp8: bool = False,
                 rocm_bf16: bool = True, cpu_flags: frozenset[str] = frozenset()
                 ) -> Features:
    """The single rule that turns (platform, capability) into feature flags.

    ROCm devices report a gfx architecture rather than an SM; their facts come
    from the caller (`rocm_fp8` for MI300-class parts). A CPU's come from its ISA flags
    (`cpu_flags`, /proc/cpuinfo's names).
    """
    if platform == "cpu":
        isa = {name: all(flag in cpu_flags for flag in flags)
               for name, flags in CPU_FEATURE_FLAGS.items()}
        return Features(bf16=True, fp16=True, **isa)
    if platform in ("rocm", "xpu"):
        return Features(bf16=rocm_bf16, fp8_e4m3=rocm_fp8, fp8_e5m2=rocm_fp8,
                        int8_tensor_cores=True, tensor_cores=True,
                        cuda_graphs=platform == "rocm")
    assert platform == "cuda" and capability is not None, "a CUDA device needs a capability"
    cap = capability
    family = cap.family
    return Features(
        bf16=cap >= SM80,
        fp8_e4m3=cap >= SM89,
        fp8_e5m2=cap >= SM89,
        nvfp4=cap >= SM100,
        # MXFP8 tensor-core support exists on data-centre Blackwell only (SM10x/SM11x).
        mxfp8=family in (100, 110),
        int8_tensor_cores=cap >= SM75,
        tensor_cores=cap >= SM70,
        cp_async=cap >= SM80,
        tma=cap >= SM90,
        # wgmma is Hopper-only: Blackwell replaced it with tcgen05 (SM100 family).
        wgmma=family == 90,
        tcgen05=family in (100, 110),
        cuda_graphs=True,
    )


# gfx targets whose matrix cores execute FP8: CDNA3 (MI300), CDNA4 (MI350), RDNA4.
_ROCM_FP8_ARCHS = ("gfx942", "gfx950", "gfx1200", "gfx1201")


def rocm_fp8_for(gcn_arch: str | None) -> bool:
    """Whether a ROCm gfx target has FP8 matrix instructions (the `rocm_fp8` fact)."""
    if not gcn_arch:
        return False
    # torch reports targets with feature suffixes, e.g. "gfx942:sramecc+:xnack-".
    return gcn_arch.split(":", 1)[0] in _ROCM_FP8_ARCHS


@dataclass(frozen=True)
class Toolchain:
    """Versions around the device. None means absent or unknown."""

    torch_version: str = ""
    driver_version: str | None = None        # e.g. "580.95.05"
    driver_cuda_version: str | None = None   # highest CUDA the driver supports, e.g. "13.0"
    runtime_version: str | None = None       # CUDA or HIP runtime of the torch build, e.g. "13.0"
    torch_arch_list: tuple[str, ...] = ()     # e.g. ("sm_80", "sm_90", "compute_90")
    torch_has_cuda: bool = False              # False for a CPU-only torch build
    libraries: dict[str, str | None] = field(default_factory=dict)  # name -> version or None

    def library(self, name: str) -> str | None:
        return self.libraries.get(name)


@dataclass(frozen=True)
class DeviceInfo:
    """One device, live or simulated."""

    id: str                                   # profile id ("h200") or "live"
    platform: str                             # cuda | rocm | xpu | cpu
    name: str
    capability: Capability | None
    memory_bytes: int
    features: Features
    toolchain: Toolchain = field(default_factory=Toolchain)
    memory_bandwidth_bytes_per_s: float | None = None
    multiprocessor_count: int | None = None
    shared_memory_per_block_bytes: int | None = None
    gcn_arch: str | None = None               # ROCm gfx target, e.g. "gfx942"
    nvidia_gpu_present: bool = False          # seen by the OS/driver even if torch cannot use it
    registers_per_block: int | None = None    # 32-bit registers a thread block may hold
    # The GPU that executes when this device is emulated (platform/emulation.py): this
    # device's capabilities, that one's silicon. None: this device is itself.
    emulated_on: DeviceInfo | None = None

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"unknown platform {self.platform!r}; expected one of {PLATFORMS}")

    # Convenience predicates that rules read.
    def has_capability(self, cap: Capability) -> bool:
        return self.capability is not None and self.capability >= cap

    @property
    def family(self) -> int | None:
        return None if self.capability is None else self.capability.family

    @property
    def is_cuda(self) -> bool:
        return self.platform == "cuda"

    @property
    def is_gpu(self) -> bool:
        return self.platform in ("cuda", "rocm", "xpu")

    def with_libraries(self, libraries: dict[str, str | None]) -> DeviceInfo:
        return replace(self, toolchain=replace(self.toolchain, libraries=dict(libraries)))

    def describe(self) -> str:
        cap = f" {self.capability}" if self.capability else ""
        text = f"{self.name} ({self.platform}{cap})"
        return text if self.emulated_on is None else (
            f"{text}, emulated on {self.emulated_on.describe()}")


__all__ = ["CUDA_REGISTERS_PER_BLOCK", "Capability", "DeviceInfo", "Features", "Toolchain",
           "features_for", "rocm_fp8_for", "SM90"]
