"""The shared vocabulary of backend rules: one way to say "this silicon cannot".

Every built-in backend derives from `RuleBackend`, which splits the registry's
``hardware_rule`` into two parts so the matrix can ask about the silicon alone:

* ``device_rule(device)`` - the device (platform, capability, family) allows it;
* ``request_rule(device, spec)`` - this request (head size, dtype, KV dtype,
  block size, quantization scheme) is one the backend accepts on that device.

Reasons are short sentences a user can act on: "needs SM80+, device is SM70".
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from archserve.kernels.registry import Backend, LibraryAssumption
from archserve.platform.capability import SM70, SM80, Capability
from archserve.platform.device import DeviceInfo

_FAMILY_NAMES = {
    70: "Volta", 80: "Ampere/Ada", 90: "Hopper", 100: "data-centre Blackwell",
    110: "Thor Blackwell", 120: "RTX Blackwell",
}


def triton_interpreted() -> bool:
    """Whether Triton kernels run on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_target_rule(device: DeviceInfo) -> str | None:
    """Triton generates code for SM70+ only (torch refuses older GPUs for it too): on a
    Pascal GPU this build's Triton kernels cannot run, whatever vLLM's rules allow."""
    if device.is_cuda and not device.has_capability(SM70):
        return f"Triton compiles for {SM70}+ only, device is {device_text(device)}"
    return None


def device_text(device: DeviceInfo) -> str:
    """How a reason names the device: its SM on CUDA, else its platform (and gfx arch)."""
    if device.capability is not None:
        return str(device.capability)
    return device.gcn_arch or device.platform


def needs_cuda(device: DeviceInfo) -> str | None:
    if device.platform != "cuda":
        return f"needs an NVIDIA GPU (CUDA), device is {device_text(device)}"
    return None


def needs_gpu(device: DeviceInfo) -> str | None:
    if not device.is_gpu:
        return "needs a GPU, device is a CPU"
    return None


def needs_triton_device(device: DeviceInfo) -> str | None:
    """Where archserve's Triton kernels run: a CUDA or ROCm GPU, or the CPU under Triton's
    interpreter (the tests)."""
    if device.platform in ("cuda", "rocm"):
        return None
    if device.platform == "cpu" and triton_interpreted():
        return None
    return "needs a GPU (runs on CPU only under TRITON_INTERPRET=1)"


def needs_capability(device: DeviceInfo, minimum: Capability) -> str | None:
    """CUDA and at least ``minimum``."""
    reason = needs_cuda(device)
    if reason:
        return reason
    if not device.has_capability(minimum):
        return f"needs {minimum}+, device is {device_text(device)}"
    return None


def needs_family(device: DeviceInfo, *families: int) -> str | None:
    """CUDA and one of the architecture families (100 matches SM100/SM103, not SM120)."""
    reason = needs_cuda(device)
    if reason:
        return reason
    if device.family not in families:
        names = " or ".join(f"SM{f} family ({_FAMILY_NAMES.get(f, 'SM' + str(f))})"
                            for f in families)
        return f"needs the {names}, device is {device_text(device)}"
    return None


def needs_dtype(dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> str | None:
    if dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        return f"computes in {names} only, requested {dtype_name(dtype)}"
    return None


def bf16_on_device(device: DeviceInfo, dtype: torch.dtype) -> str | None:
    """bfloat16 arithmetic is a silicon feature (SM80+ on CUDA)."""
    if dtype == torch.bfloat16 and not device.features.bf16:
        where = f"needs {SM80}+" if device.is_cuda else "is not supported"
        return f"bfloat16 {where}, device is {device_text(device)}"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def runtime_at_least(device: DeviceInfo, version: tuple[int, int]) -> str | None:
    """The CUDA runtime of this build is new enough; an unknown runtime is not held against it."""
    text = device.toolchain.runtime_version
    if not text or not device.is_cuda:
        return None
    try:
        have = tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        return None
    if have < version:
        return f"needs CUDA runtime {version[0]}.{version[1]}+, this build has {text}"
    return None


class RuleBackend(Backend):
    """A built-in backend: device rule + request rule + availability + lazy implementation."""

    preferred_block_size: int = 16
    impl_path: str | None = None     # "module:Class", built as Class(device, spec)

    def device_rule(self, device: DeviceInfo) -> str | None:
        return None

    def request_rule(self, device: DeviceInfo, spec: Any) -> str | None:
        return None

    def hardware_rule(self, device: DeviceInfo, spec: Any) -> str | None:
        return self.device_rule(device) or self.request_rule(device, spec)

    def runtime_rule(self, device: DeviceInfo) -> str | None:
        """Toolchain requirements (CUDA runtime version) of this build; part of availability."""
        return None

    def availability(self, device: DeviceInfo, libraries: LibraryAssumption = "installed"
                     ) -> str | None:
        return (super().availability(device, libraries) or self.runtime_rule(device)
                or (triton_target_rule(device) if self.library == "triton" else None))

    def detail(self, device: DeviceInfo, spec: Any) -> str:
        """What this backend would run here when that varies by device (e.g. "FA3"); else ""."""
        return ""

    def make_impl(self, device: DeviceInfo, spec: Any) -> Any:
        if self.impl_path is None:
            return super().make_impl(device, spec)
        module_name, _, attr = self.impl_path.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
        return cls(device, spec)


def backend_class(base: type[RuleBackend], name: str, **attrs: Any) -> type[RuleBackend]:
    """A backend whose rules are all ``base``'s and whose differences are data (name,
    formats, families, text): a table row, made a class so the registry and the priority
    code treat it like any other backend."""
    class_name = "".join(part.title() for part in name.split("_")) + "Backend"
    return type(class_name, (base,), {"name": name, **attrs})


class FamilyGated(RuleBackend):
    """Runs on the SM families in ``families`` only (90: Hopper, 100, 120, ...)."""

    families: tuple[int, ...] = ()     # empty: no family gate

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_family(device, *self.families) if self.families else None


def block_size_rule(block_size: int | None, *, multiple_of: int | None = None,
                    choices: tuple[int, ...] | None = None) -> str | None:
    """A user-given KV block size constrains the backend; None means "use the preferred one"."""
    if block_size is None:
        return None
    if multiple_of is not None and block_size % multiple_of:
        return f"KV block size must be a multiple of {multiple_of}, requested {block_size}"
    if choices is not None and block_size not in choices:
        return (f"KV block size must be one of {', '.join(map(str, choices))}, "
                f"requested {block_size}")
    return None
