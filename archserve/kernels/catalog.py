"""The default registry: every built-in backend of every op kind, and the selection helpers.

Callers select through these helpers (or ``default_registry().select``); an explicit
override wins, else ``ARCHSERVE_<OP>_BACKEND`` from the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from archserve.kernels.attention.backends import (
    ATTENTION_BACKENDS,
    ATTENTION_FALLBACK,
    attention_priority,
)
from archserve.kernels.linear.quantized_backends import QUANTIZED_LINEAR_BACKENDS
from archserve.kernels.linear.rules import LINEAR_BACKENDS, LINEAR_FALLBACK, linear_priority
from archserve.kernels.lora.rules import LORA_BACKENDS, LORA_FALLBACK, lora_priority
from archserve.kernels.mla.backends import MLA_BACKENDS, MLA_FALLBACK
from archserve.kernels.mla.dsv4_backends import (
    DSV4_BACKENDS,
    mla_attention_priority,
)
from archserve.kernels.moe.rules import MOE_BACKENDS, MOE_FALLBACK, moe_priority
from archserve.kernels.registry import (
    Backend,
    LibraryAssumption,
    Registry,
    Selection,
    override_from_env,
)
from archserve.kernels.specs import AttentionSpec, LinearSpec, LoRASpec, MoESpec
from archserve.platform.device import DeviceInfo

ExtraReject = Callable[[Backend], str | None]


def build_registry() -> Registry:
    """A fresh registry holding every built-in backend (tests build their own)."""
    registry = Registry()
    for classes, op, priority, fallback in (
        (ATTENTION_BACKENDS, "attention", attention_priority, ATTENTION_FALLBACK),
        (MLA_BACKENDS + DSV4_BACKENDS, "mla_attention", mla_attention_priority,
         MLA_FALLBACK),
        (LINEAR_BACKENDS + QUANTIZED_LINEAR_BACKENDS, "linear", linear_priority,
         LINEAR_FALLBACK),
        (MOE_BACKENDS, "moe", moe_priority, MOE_FALLBACK),
        (LORA_BACKENDS, "lora", lora_priority, LORA_FALLBACK),
    ):
        for cls in classes:
            registry.register(cls())
        registry.set_priority(op, priority, fallback)
    return registry


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The process-wide registry (built once; plug-ins load on first lookup)."""
    return build_registry()


def _select(op: str, device: DeviceInfo, spec: object, libraries: LibraryAssumption,
            override: str | None, extra_reject: ExtraReject | None) -> Selection:
    return default_registry().select(op, device, spec, libraries=libraries,
                                     override=override_from_env(op, override),
                                     extra_reject=extra_reject)


def select_attention_backend(device: DeviceInfo, spec: AttentionSpec,
                             libraries: LibraryAssumption = "installed",
                             override: str | None = None,
                             extra_reject: ExtraReject | None = None) -> Selection:
    """Standard attention, or MLA when ``spec.use_mla`` (each has its own backends)."""
    op = "mla_attention" if spec.use_mla else "attention"
    return _select(op, device, spec, libraries, override, extra_reject)


def select_mla_backend(device: DeviceInfo, spec: AttentionSpec,
                       libraries: LibraryAssumption = "installed", override: str | None = None,
                       extra_reject: ExtraReject | None = None) -> Selection:
    return _select("mla_attention", device, spec, libraries, override, extra_reject)


def select_linear_backend(device: DeviceInfo, spec: LinearSpec,
                          libraries: LibraryAssumption = "installed",
                          override: str | None = None,
                          extra_reject: ExtraReject | None = None) -> Selection:
    return _select("linear", device, spec, libraries, override, extra_reject)


def select_moe_backend(device: DeviceInfo, spec: MoESpec,
                       libraries: LibraryAssumption = "installed", override: str | None = None,
                       extra_reject: ExtraReject | None = None) -> Selection:
    return _select("moe", device, spec, libraries, override, extra_reject)


def select_lora_backend(device: DeviceInfo, spec: LoRASpec,
                        libraries: LibraryAssumption = "installed", override: str | None = None,
                        extra_reject: ExtraReject | None = None) -> Selection:
    return _select("lora", device, spec, libraries, override, extra_reject)
