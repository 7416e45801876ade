"""What is this hardware and toolchain: capabilities, devices, profiles, detection, diagnosis.

Importing this package does not import torch; `detect()` does, when called.
"""

from archserve.platform.capability import Capability
from archserve.platform.detect import detect, resolve_device
from archserve.platform.device import DeviceInfo, Features, Toolchain
from archserve.platform.profiles import (
    ALIASES,
    PROFILE_IDS,
    all_profiles,
    get_profile,
)
from archserve.platform.toolchain import Finding, arch_verdict, diagnose, three_layer_verdict

__all__ = [
    "ALIASES",
    "PROFILE_IDS",
    "Capability",
    "DeviceInfo",
    "Features",
    "Finding",
    "Toolchain",
    "all_profiles",
    "arch_verdict",
    "detect",
    "diagnose",
    "get_profile",
    "resolve_device",
    "three_layer_verdict",
]
