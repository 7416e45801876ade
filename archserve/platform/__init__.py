"""What is this hardware and toolchain: capabilities, devices, profiles, detection."""

from archserve.platform.capability import Capability
from archserve.platform.device import DeviceInfo, Features, Toolchain
from archserve.platform.profiles import (
    ALIASES,
    PROFILE_IDS,
    all_profiles,
    get_profile,
    resolve_device,
)

__all__ = [
    "ALIASES",
    "PROFILE_IDS",
    "Capability",
    "DeviceInfo",
    "Features",
    "Toolchain",
    "all_profiles",
    "get_profile",
    "resolve_device",
]
