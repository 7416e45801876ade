"""Compiled and autotuned kernels persist on disk, keyed by what invalidates them.

Triton keys its compile cache by source and options, but an autotune result measured on
one GPU, driver or library version is wrong for another. Giving each (device, driver,
runtime, torch, triton) combination its own cache directory makes a second start on
the same machine skip both compilation and autotuning, and keeps a mixed fleet's shared
home directory from serving one GPU another's tuning.
"""

from __future__ import annotations

import hashlib
import os

from archserve.cache import cache_dir
from archserve.platform import DeviceInfo


def kernel_cache_key(device: DeviceInfo) -> str:
    tc = device.toolchain
    parts = [device.name, str(device.capability), tc.driver_version or "", tc.runtime_version or "",
             tc.torch_version, tc.library("triton") or ""]
    if device.emulated_on is not None:
        # Kernels built for the profile and timed on another GPU: neither that GPU's own
        # cache nor a real one of the profile's may serve them.
        parts.append(f"emulated on {device.emulated_on.name} {device.emulated_on.capability}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def device_kernel_dir(device: DeviceInfo) -> str:
    """This device's directory for what is compiled and tuned on it."""
    return cache_dir("kernels", kernel_cache_key(device))


def configure_kernel_caches(device: DeviceInfo) -> str | None:
    """Point Triton's cache (compiles and autotune results) at this device's directory.

    A cache directory the user chose (TRITON_CACHE_DIR) is respected. Returns the
    directory in use, or None on a CPU (nothing is compiled there).
    """
    if not device.is_gpu:
        return None
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = device_kernel_dir(device)
    # Persist autotune timings too (read by triton.autotune at first use of a kernel).
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return os.environ["TRITON_CACHE_DIR"]
