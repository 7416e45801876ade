"""Toolchain diagnosis: does driver, CUDA runtime, torch build and kernel library fit the device?

Everything here reads a `DeviceInfo`, so every diagnosis can be produced by
simulation (a profile with a chosen `Toolchain`) as well as live. A problem is a
`Finding` with a stable code, a plain-words explanation and a concrete remedy;
never a stack trace.

The three layers that must agree on an NVIDIA machine:
  driver  -> supports CUDA up to some version (NVML reports it);
  runtime -> the CUDA version torch was built with (must not be newer than the driver,
             except within one major version through minor-version compatibility);
  build   -> the GPU architectures compiled into torch (must cover the device).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from archserve.platform.capability import SM75, SM80, SM121, Capability
from archserve.platform.device import DeviceInfo

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    title: str
    detail: str
    remedy: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.title}\n  {self.detail}\n  fix: {self.remedy}"


# --- versions -----------------------------------------------------------------------

# Minimum Linux driver for each CUDA runtime (NVIDIA CUDA toolkit release notes).
MIN_DRIVER_FOR_CUDA: dict[str, str] = {
    "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03", "12.3": "545.23.06",
    "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03", "12.8": "570.26",
    "12.9": "575.51.03", "13.0": "580.65.06",
}


def version_tuple(text: str) -> tuple[int, ...]:
    """"580.65.06" -> (580, 65, 6); "12.8" -> (12, 8); "7.0.51831-abc" -> (7, 0, 51831)."""
    parts = []
    for piece in text.strip().split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def _major_minor(text: str) -> tuple[int, int]:
    numbers = version_tuple(text) + (0, 0)
    return numbers[0], numbers[1]


def min_driver_for(cuda: str) -> str | None:
    """The minimum driver for a CUDA version; a later minor than the table knows uses
    the newest known entry of the same major (a lower bound, never a guess upward)."""
    wanted = _major_minor(cuda)
    known = [(_major_minor(v), d) for v, d in MIN_DRIVER_FOR_CUDA.items()]
    same_major = [(mm, d) for mm, d in known if mm[0] == wanted[0] and mm <= wanted]
    return max(same_major)[1] if same_major else None


def min_driver_for_major(cuda_major: int) -> str | None:
    """The driver that minor-version compatibility needs for any CUDA ``major``.x."""
    entries = [(_major_minor(v), d) for v, d in MIN_DRIVER_FOR_CUDA.items()]
    same = [(mm, d) for mm, d in entries if mm[0] == cuda_major]
    return min(same)[1] if same else None


def driver_max_cuda(device: DeviceInfo) -> str | None:
    """The newest CUDA the driver supports: NVML's answer, else derived from the table."""
    tc = device.toolchain
    if tc.driver_cuda_version:
        return tc.driver_cuda_version
    if not tc.driver_version:
        return None
    driver = version_tuple(tc.driver_version)
    supported = [v for v, d in MIN_DRIVER_FOR_CUDA.items() if version_tuple(d) <= driver]
    return max(supported, key=_major_minor) if supported else None


# --- torch build vs architecture -----------------------------------------------------


def _parse_arch_entry(entry: str) -> tuple[str, Capability, str] | None:
    """"sm_90a" -> ("sm", 9.0, "a"); "compute_120" -> ("compute", 12.0, ""); gfx -> None."""
    kind, _, rest = entry.strip().lower().partition("_")
    if kind not in ("sm", "compute") or not rest:
        return None
    suffix = rest[-1] if rest[-1] in "af" else ""
    try:
        return kind, Capability.parse(rest.removesuffix(suffix)), suffix
    except ValueError:
        return None


def arch_entry_runs_on(entry: str, cap: Capability) -> bool:
    """Whether code compiled for one arch-list entry can run on a device of ``cap``.

    * ``sm_XY`` (cubin) runs on the same major with minor >= Y (sm_80 runs on SM86,
      sm_100 on SM103, sm_120 on SM121), never across majors.
    * ``sm_XYa`` / ``compute_XYa`` are arch-specific: exactly X.Y, no forward port.
    * ``sm_XYf`` / ``compute_XYf`` are family-specific: same major, minor >= Y.
    * ``compute_XY`` (PTX) is JIT-compiled by the driver for any capability >= X.Y.
    """
    parsed = _parse_arch_entry(entry)
    if parsed is None:
        return False
    kind, built, suffix = parsed
    if suffix == "a":
        return cap == built
    if kind == "sm" or suffix == "f":
        return cap.major == built.major and cap.minor >= built.minor
    return cap >= built


def covering_arch(cap: Capability, arch_list: tuple[str, ...] | list[str]) -> str | None:
    """The arch-list entry that will serve ``cap``: native code first, then PTX."""
    runs = [e for e in arch_list if arch_entry_runs_on(e, cap)]
    native = [e for e in runs if e.startswith("sm_")]
    return (native or runs or [None])[0]


@dataclass(frozen=True)
class TorchWheel:
    """One PyTorch wheel index: its CUDA runtime and the architectures it ships."""

    tag: str
    cuda: str
    arch_list: tuple[str, ...]

    @property
    def index_url(self) -> str:
        return f"https://download.pytorch.org/whl/{self.tag}"


# The CUDA wheel indexes of current torch releases (2.9-2.11), newest first. CUDA 12.8+
# wheels dropped Volta; Blackwell (sm_100/sm_120) needs 12.8+. The cu130 list is what
# torch 2.11.0+cu130 reports on x86-64 (checked on an H200).
TORCH_WHEELS: tuple[TorchWheel, ...] = (
    TorchWheel("cu130", "13.0", ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")),
    TorchWheel("cu128", "12.8", ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")),
    TorchWheel("cu126", "12.6", ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")),
)


def suggest_torch_wheel(cap: Capability | None, driver_cuda: str | None) -> tuple[TorchWheel, bool]:
    """The newest wheel that covers ``cap`` (any wheel when unknown) and that the driver
    can run. Returns (wheel, driver_ok); driver_ok False means the driver must be
    upgraded too (then the newest covering wheel is returned)."""
    covering = [w for w in TORCH_WHEELS if cap is None or covering_arch(cap, w.arch_list)]
    if not covering:
        covering = [TORCH_WHEELS[0]]
    if driver_cuda is None:
        return covering[0], True
    for wheel in covering:
        if _major_minor(wheel.cuda) <= _major_minor(driver_cuda):
            return wheel, True
    return covering[0], False


def _pip_torch(wheel: TorchWheel) -> str:
    return f"pip install --force-reinstall torch --index-url {wheel.index_url}"


def _wheel_advice(device: DeviceInfo) -> str:
    wheel, driver_ok = suggest_torch_wheel(device.capability, driver_max_cuda(device))
    advice = f"{_pip_torch(wheel)} (CUDA {wheel.cuda} build)"
    if not driver_ok:
        advice += (f"; first upgrade the NVIDIA driver to >= {min_driver_for(wheel.cuda)}, "
                   f"which CUDA {wheel.cuda} needs")
    return advice


def _arch_range(arch_list: tuple[str, ...]) -> str:
    if not arch_list:
        return "no GPU architectures"
    if len(arch_list) <= 3:
        return ", ".join(arch_list)
    return f"{arch_list[0]} .. {arch_list[-1]}"


def arch_verdict(device: DeviceInfo) -> tuple[bool, str]:
    """Whether torch's build covers this device's architecture, in one sentence."""
    tc = device.toolchain
    if not device.is_gpu:
        return True, "no GPU in use: torch's GPU architectures do not matter"
    if not tc.torch_has_cuda:
        return False, f"torch {tc.torch_version} has no GPU support at all"
    if not tc.torch_arch_list:
        return True, f"torch {tc.torch_version} did not report its architectures; assuming they fit"
    if device.platform == "rocm":
        target = (device.gcn_arch or "").split(":", 1)[0]
        built = {e.split(":", 1)[0] for e in tc.torch_arch_list}
        if target and target not in built:
            return False, (f"torch {tc.torch_version} is built for {_arch_range(tc.torch_arch_list)}"
                           f", not {target}")
        return True, f"torch {tc.torch_version} includes {target or 'this GPU'}"
    if device.capability is None:
        return True, "device capability unknown; cannot check torch's architectures"
    cap = device.capability
    entry = covering_arch(cap, tc.torch_arch_list)
    built_for = f"torch {tc.torch_version} is built for {_arch_range(tc.torch_arch_list)}"
    if entry is None:
        return False, f"{built_for}; nothing there runs on {cap} ({cap.arch})"
    if entry == cap.arch:
        return True, f"{built_for}; {cap} runs its native {entry} code"
    if entry.startswith("sm_"):
        return True, f"{built_for}; {cap} runs the {entry} code (same major, older minor)"
    return True, (f"{built_for}; {cap} has no native code and JIT-compiles the {entry} PTX "
                  "(slow first start, kernels not tuned for it)")


def _arch_finding(device: DeviceInfo) -> Finding | None:
    tc = device.toolchain
    if not device.is_gpu or not tc.torch_has_cuda:
        return None
    ok, text = arch_verdict(device)
    if ok:
        return None
    if device.platform == "rocm":
        remedy = ("install a torch ROCm wheel built for this GPU, e.g. "
                  "pip install torch --index-url https://download.pytorch.org/whl/rocm7.0")
        target = device.gcn_arch
    else:
        remedy = _wheel_advice(device)
        target = device.capability.arch if device.capability else "this GPU"
    return Finding(
        code="arch_not_in_torch_build",
        severity="error",
        title=f"{device.name}: {target} is not compatible with the installed PyTorch",
        detail=(f"{text}. Every CUDA kernel would fail with 'no kernel image is available "
                "for execution on the device'."),
        remedy=remedy,
    )


# --- runtime vs driver ---------------------------------------------------------------


def _runtime_finding(device: DeviceInfo) -> Finding | None:
    tc = device.toolchain
    # A CUDA torch whose runtime the driver rejects cannot initialise the GPU, so
    # detect() falls back to the CPU: check there too when an NVIDIA GPU is present.
    on_nvidia = device.is_cuda or (device.platform == "cpu" and device.nvidia_gpu_present)
    if not on_nvidia or not tc.torch_has_cuda or not tc.runtime_version:
        return None
    driver_cuda = driver_max_cuda(device)
    if driver_cuda is None or _major_minor(tc.runtime_version) <= _major_minor(driver_cuda):
        return None
    runtime = tc.runtime_version
    needed = min_driver_for(runtime) or "the newest available"
    driver = tc.driver_version or "unknown"
    older_wheel = next((w for w in TORCH_WHEELS
                        if _major_minor(w.cuda) <= _major_minor(driver_cuda)
                        and (device.capability is None
                             or covering_arch(device.capability, w.arch_list))), None)
    remedy = f"upgrade the NVIDIA driver to >= {needed} (CUDA {runtime})"
    if older_wheel:
        remedy += f", or install a torch built for CUDA {older_wheel.cuda}: {_pip_torch(older_wheel)}"
    runtime_major = _major_minor(runtime)[0]
    compat_driver = min_driver_for_major(runtime_major)
    same_major = _major_minor(driver_cuda)[0] == runtime_major
    if (same_major and compat_driver and tc.driver_version
            and version_tuple(tc.driver_version) >= version_tuple(compat_driver)):
        return Finding(
            code="runtime_newer_than_driver",
            severity="warning",
            title=f"torch's CUDA {runtime} runtime is newer than the driver's CUDA {driver_cuda}",
            detail=(f"Driver {driver} supports CUDA up to {driver_cuda}. Within CUDA "
                    f"{runtime_major}.x this usually works (minor-version compatibility, driver "
                    f">= {compat_driver}), but PTX compiled by the newer toolkit and some new "
                    "APIs fail to load."),
            remedy=remedy,
        )
    return Finding(
        code="runtime_newer_than_driver",
        severity="error",
        title=f"torch's CUDA {runtime} runtime needs a newer driver than {driver}",
        detail=(f"Driver {driver} supports CUDA up to {driver_cuda}; torch was built with CUDA "
                f"{runtime}. CUDA initialisation fails ('the NVIDIA driver on your system is too "
                "old' / 'CUDA driver version is insufficient')."),
        remedy=remedy,
    )


# --- CPU torch on an NVIDIA machine --------------------------------------------------


def _cpu_torch_finding(device: DeviceInfo) -> Finding | None:
    tc = device.toolchain
    if tc.torch_has_cuda or not device.nvidia_gpu_present:
        return None
    return Finding(
        code="cpu_torch_with_nvidia_gpu",
        severity="error",
        title="an NVIDIA GPU is present but the installed torch is a CPU-only build",
        detail=(f"torch {tc.torch_version or '(unknown)'} was built without CUDA, so "
                "everything runs on the CPU while the GPU sits idle."),
        remedy=_wheel_advice(device),
    )


# --- optional kernel libraries -------------------------------------------------------


@dataclass(frozen=True)
class KernelLibrary:
    """An optional kernel library: its import name, pip distribution and hardware range.

    ``cuda_min``/``cuda_max`` bound the capability; ``cuda_families`` (when set) lists the
    only families it is built for; ``rocm`` says whether a ROCm build exists.
    """

    module: str
    distribution: str
    cuda_min: Capability | None = None
    cuda_max: Capability | None = None
    cuda_families: tuple[int, ...] = ()
    rocm: bool = False
    gpu_only: bool = True

    def unusable_reason(self, device: DeviceInfo) -> str | None:
        """None if this library can run on the device, else why not."""
        if not self.gpu_only:
            return None
        if device.platform == "rocm":
            return None if self.rocm else f"{self.module} has no ROCm build"
        if not device.is_cuda or device.capability is None:
            return f"{self.module} needs an NVIDIA GPU; this device is {device.platform}"
        cap = device.capability
        if self.cuda_families and cap.family not in self.cuda_families:
            families = "/".join(f"SM{f}" for f in self.cuda_families)
            return f"{self.module} is built for {families} only; device is {cap}"
        if self.cuda_min and cap < self.cuda_min:
            return f"{self.module} needs {self.cuda_min}+; device is {cap}"
        if self.cuda_max and cap > self.cuda_max:
            return f"{self.module} supports up to {self.cuda_max}; device is {cap}"
        return None


# Minimal hardware facts for diagnosis only. The attention backends own the full rules
# (archserve/kernels/attention/); this table is to be unified with them.
KERNEL_LIBRARIES: dict[str, KernelLibrary] = {
    lib.module: lib for lib in (
        KernelLibrary("triton", "triton", gpu_only=False),   # also used via TRITON_INTERPRET
        KernelLibrary("flash_attn", "flash-attn", cuda_min=SM80, rocm=True),
        KernelLibrary("vllm_flash_attn", "vllm-flash-attn", cuda_min=SM80),
        KernelLibrary("flash_attn_interface", "flash-attn-3", cuda_families=(90,)),
        KernelLibrary("flashinfer", "flashinfer-python", cuda_min=SM75, cuda_max=SM121),
        KernelLibrary("deep_gemm", "deep-gemm", cuda_families=(90, 100)),
    )
}


def _library_findings(device: DeviceInfo) -> list[Finding]:
    findings = []
    for module, version in device.toolchain.libraries.items():
        lib = KERNEL_LIBRARIES.get(module)
        if version is None or lib is None:
            continue
        reason = lib.unusable_reason(device)
        if reason is None:
            continue
        findings.append(Finding(
            code="library_unusable",
            severity="warning",
            title=f"{module} {version} is installed but cannot run on {device.describe()}",
            detail=f"{reason}. archserve skips it and selects the next backend.",
            remedy=(f"nothing is broken; to silence this, pip uninstall {lib.distribution}"),
        ))
    return findings


# --- public entry points -------------------------------------------------------------


def diagnose(device: DeviceInfo) -> list[Finding]:
    """Every toolchain problem on this device, most severe first; [] when healthy."""
    findings = [f for f in (_cpu_torch_finding(device), _arch_finding(device),
                            _runtime_finding(device)) if f is not None]
    findings += _library_findings(device)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])


def three_layer_verdict(device: DeviceInfo) -> tuple[bool, str]:
    """Driver / CUDA runtime / torch build: do they fit together and fit the device?"""
    tc = device.toolchain
    if device.platform == "cpu" and not device.nvidia_gpu_present:
        return True, f"CPU only: torch {tc.torch_version or '(unknown)'}, no GPU driver involved"
    driver_cuda = driver_max_cuda(device)
    driver = tc.driver_version or "unknown"
    lines = [f"driver:  {driver}" + (f" (CUDA <= {driver_cuda})" if driver_cuda else "")]
    problems = {f.code: f for f in (_cpu_torch_finding(device), _runtime_finding(device))
                if f is not None}
    if "cpu_torch_with_nvidia_gpu" in problems:
        lines.append(f"runtime: none - torch {tc.torch_version} is a CPU-only build  [mismatch]")
    elif tc.runtime_version:
        runtime_problem = problems.get("runtime_newer_than_driver")
        mark = "ok" if runtime_problem is None else runtime_problem.severity
        kind = "HIP" if device.platform == "rocm" else "CUDA"
        lines.append(f"runtime: {kind} {tc.runtime_version} (torch {tc.torch_version})  [{mark}]")
    arch_ok, arch_text = arch_verdict(device)
    lines.append(f"build:   {arch_text}  [{'ok' if arch_ok else 'mismatch'}]")
    ok = arch_ok and not any(f.severity == "error" for f in problems.values())
    return ok, "\n".join(lines)


__all__ = [
    "Finding", "KERNEL_LIBRARIES", "KernelLibrary", "MIN_DRIVER_FOR_CUDA", "TORCH_WHEELS",
    "TorchWheel", "arch_entry_runs_on", "arch_verdict", "covering_arch", "diagnose",
    "driver_max_cuda", "min_driver_for", "suggest_torch_wheel", "three_layer_verdict",
]
