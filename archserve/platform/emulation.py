"""Emulation: compute on the GPU here with another GPU's capability model.

``--emulate-device PROFILE`` narrows the detected device to a profile: from then on
``detect()`` and ``device_info_for`` answer with the profile's capability, features (no
bfloat16 on SM7x, no FP8 tensor cores below SM89, no TMA / wgmma / PDL below SM90),
shared memory and registers per block and SM count, so every dtype decision, route, tile
and tuner candidate is the one that GPU would get, and the kernel cache key is its own.
What stays this GPU's: its memory (the KV pool is sized from what is here), its
bandwidth and its toolchain (torch build, driver, installed libraries).

Triton builds every kernel for the profile's architecture (``TRITON_OVERRIDE_ARCH``:
Triton lowers for that capability and assembles the result for this GPU, so an SM80
profile gets mma.sync and cp.async, never wgmma or TMA), and each compiled kernel is
held to the profile's shared-memory and register limits: one over them fails as it would
on that GPU, and an autotuner or start-up tuner drops it as it would there.

Only an older GPU of the same vendor can be emulated, and only one whose every feature
this GPU has: SM100 or SM120 instructions do not run on an H200, AMD code objects are
built per gfx target, and a GPU cannot be emulated on a CPU. Not emulated: torch's and
cuBLAS's own kernels (they run this GPU's code) and timings.

Triton keeps compiled kernels per process, keyed without the target, so the first GPU
engine of a process fixes its emulation (or its absence); an engine asking for another
in the same process is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

from archserve.platform.detect import detect, detect_present, set_standing_in, standing_in
from archserve.platform.device import DeviceInfo, Features
from archserve.platform.profiles import get_profile

TRITON_ARCH_ENV = "TRITON_OVERRIDE_ARCH"
_VENDORS = {"cuda": "an NVIDIA", "rocm": "an AMD", "xpu": "an Intel"}
_NATIVE = "native"
_fixed: str | None = None        # the process's choice once a GPU engine started


class EmulationRefused(ValueError):
    """A profile this machine cannot emulate; the message says why."""


def emulation_refusal(present: DeviceInfo, profile: DeviceInfo) -> str | None:
    """Why the GPU ``present`` cannot execute what ``profile``'s route launches, or None."""
    if not profile.is_gpu:
        return f"{profile.id} is not a GPU: run on the CPU with --device cpu instead"
    if not present.is_gpu:
        return (f"there is no GPU here to emulate {profile.id} on ({present.describe()}); "
                f"`archserve explain --device {profile.id}` shows its route without one")
    if present.platform != profile.platform:
        return (f"{profile.id} is {_VENDORS[profile.platform]} GPU and this is "
                f"{present.describe()}: its kernels are built for another instruction set")
    if profile.platform != "cuda":
        here, there = _gfx(present.gcn_arch), _gfx(profile.gcn_arch)
        if here != there:
            return (f"AMD code objects are built for one gfx target: {profile.id} is {there}, "
                    f"this GPU is {here}")
        return None
    missing = missing_features(present.features, profile.features)
    if profile.capability > present.capability:
        what = ", ".join(missing) if missing else "its instructions"
        return (f"{profile.id} is {profile.capability}, newer than this "
                f"{present.describe()}: {what} do not run on {present.capability}")
    if missing:
        return (f"{profile.id} ({profile.capability}) uses {', '.join(missing)}, which "
                f"{present.describe()} does not have")
    return None


def missing_features(present: Features, profile: Features) -> list[str]:
    """The profile's hardware features this device lacks (wgmma on a Blackwell, say)."""
    return [f.name for f in fields(Features)
            if getattr(profile, f.name) and not getattr(present, f.name)]


def _gfx(gcn_arch: str | None) -> str:
    # torch reports targets with feature suffixes, e.g. "gfx942:sramecc+:xnack-".
    return (gcn_arch or "unknown").split(":", 1)[0]


def narrow(present: DeviceInfo, profile: DeviceInfo) -> DeviceInfo:
    """``profile``'s capability model on ``present``'s silicon and toolchain (the caller
    checked ``emulation_refusal``)."""
    return replace(profile, memory_bytes=present.memory_bytes, toolchain=present.toolchain,
                   memory_bandwidth_bytes_per_s=present.memory_bandwidth_bytes_per_s,
                   nvidia_gpu_present=present.nvidia_gpu_present, emulated_on=present)


def emulation_summary(device: DeviceInfo) -> str:
    """What an emulated device takes from its profile and what from the GPU it runs on."""
    target = device.capability.arch if device.capability else device.gcn_arch
    return (f"{device.id}'s capability model (its dtypes, features, shared memory and "
            f"registers per block, SM count; Triton kernels built for {target}) on this "
            f"GPU's silicon; memory, bandwidth, the toolchain and torch's own kernels are "
            f"this GPU's")


def emulate(profile_id: str | None) -> DeviceInfo:
    """Fix this process's GPU: ``profile_id`` emulated on the GPU here, or None for the GPU
    as it is. Returns what ``detect()`` answers from now on. Raises EmulationRefused when
    the GPU cannot execute the profile, or when an engine of this process already runs
    another choice (see the module doc)."""
    global _fixed
    choice = _NATIVE if profile_id is None else get_profile(profile_id).id
    if _fixed is not None and _fixed != choice:
        ran = "no emulation" if _fixed == _NATIVE else f"--emulate-device {_fixed}"
        asked = "no emulation" if choice == _NATIVE else f"--emulate-device {choice}"
        raise EmulationRefused(
            f"this process already started a GPU engine with {ran}, so it cannot start one "
            f"with {asked}: Triton keeps the kernels it compiled per process, whatever "
            f"their target; start a new process")
    if choice == _NATIVE:
        _fixed = _NATIVE
        return detect()
    present = detect_present()
    profile = get_profile(choice)
    reason = emulation_refusal(present, profile)
    if reason is not None:
        raise EmulationRefused(f"cannot emulate {choice}: {reason}")
    device = narrow(present, profile)
    if profile.is_cuda:
        os.environ[TRITON_ARCH_ENV] = f"sm{profile.capability.to_int()}"
        hold_kernels_to_limits(device)
    set_standing_in(device)
    _fixed = choice
    return device


def emulated_profile() -> str | None:
    """The profile this process emulates, or None."""
    return None if _fixed in (None, _NATIVE) else _fixed


@contextlib.contextmanager
def compile_target(profile: DeviceInfo) -> Iterator[DeviceInfo]:
    """Within the block every tensor, a CPU one included, stands for ``profile``'s GPU:
    kernel wrappers choose tiles, features and launch options for it, as the engine would
    there. For compiling kernels for a GPU this machine need not have (nothing executes:
    the caller compiles instead of launching)."""
    previous, for_every_tensor = standing_in()
    set_standing_in(profile, for_every_tensor=True)
    try:
        yield profile
    finally:
        set_standing_in(previous, for_every_tensor=for_every_tensor)


# ---- Triton: every compiled kernel held to the emulated device's limits ----------------

def limit_violation(device: DeviceInfo, shared_bytes: int, registers_per_thread: int,
                    num_warps: int, warp_size: int = 32) -> tuple[int, int, str] | None:
    """(needed, limit, resource) of the first per-block limit of ``device`` a kernel
    breaks, or None (an unknown limit is not held against it)."""
    smem = device.shared_memory_per_block_bytes
    if smem is not None and shared_bytes > smem:
        return shared_bytes, smem, "shared memory"
    registers = registers_per_thread * num_warps * warp_size
    if device.registers_per_block is not None and registers > device.registers_per_block:
        return registers, device.registers_per_block, "registers"
    return None


def hold_kernels_to_limits(device: DeviceInfo) -> bool:
    """Install a Triton post-compile hook that fails a kernel over ``device``'s limits
    with Triton's own OutOfResources (and forgets it, so the next launch compiles again
    and fails again). False where Triton or its hook is absent."""
    try:
        from triton import knobs
        from triton.runtime.errors import OutOfResources
        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False
    previous = getattr(previous, "archserve_previous", previous)

    def hook(*args: Any, **kwargs: Any) -> Any:
        result = previous(*args, **kwargs) if previous is not None else None
        kernel, forget = _compiled_kernel(kwargs)
        if kernel is not None:
            kernel._init_handles()   # loads it, as its first launch would, for n_regs
            violation = limit_violation(device, kernel.metadata.shared,
                                        getattr(kernel, "n_regs", 0) or 0,
                                        kernel.metadata.num_warps)
            if violation is not None:
                forget()
                raise OutOfResources(*violation)
        return result

    hook.archserve_previous = previous   # type: ignore[attr-defined]
    runtime.jit_post_compile_hook = hook
    return True


def _compiled_kernel(hook_kwargs: dict) -> tuple[Any, Any]:
    """(the kernel the hook reports, a function that drops it from its JIT cache)."""
    try:
        jit = hook_kwargs["fn"].jit_function
        cache = jit.device_caches[hook_kwargs["compile"]["device"]][0]
        key = hook_kwargs["key"]
        return cache.get(key), lambda: cache.pop(key, None)
    except (KeyError, AttributeError, IndexError, TypeError):
        return None, lambda: None
