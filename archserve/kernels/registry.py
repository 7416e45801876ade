"""The backend registry: one place where every implementation of every op kind lives.

A backend answers two separate questions:

* ``hardware_rule(device, spec)`` - can this silicon run it at all (the *ideal* route);
* ``availability(device)`` - is the implementation in this build and its library
  importable (the *installed* route).

``check`` combines both. Selection (``select``) walks a priority list produced by one
small function per op kind, records why every rejected candidate was rejected, and
ends in the op kind's universal PyTorch fallback, so it never fails on a supported
request. Third parties register through the ``archserve.backends`` entry point group:
each entry point is a callable that receives the registry (or a module that
registers on import).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from archserve.platform.device import DeviceInfo

log = logging.getLogger(__name__)

OP_KINDS = ("attention", "mla_attention", "linear", "moe", "lora")
# vLLM's attention types (AttentionSpec.attn_type). Here, with OP_KINDS, so that argument
# checks can name them without importing torch.
ATTENTION_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")
ENTRY_POINT_GROUP = "archserve.backends"

# How selection treats optional kernel libraries:
#   "installed" - a library must be importable here (the live default);
#   "all"       - assume every library is present (profiles' default: the ideal route);
#   "none"      - assume no optional library is present;
#   a set of names - exactly those libraries are present.
LibraryAssumption = str | frozenset[str]


class Backend:
    """Base class for one implementation of one op kind.

    Subclasses set ``name`` (stable, upper case), ``op`` and optionally ``library``
    (the import name of the kernel library it needs) and ``implemented`` (False when
    the rules are registered but archserve does not ship an implementation yet).
    """

    name: str = ""
    op: str = ""
    library: str | None = None
    implemented: bool = True
    description: str = ""
    # True when the op reads every per-step size from device tensors, so a CUDA graph
    # captured once stays right as batch contents change (attention: sequence lengths).
    graph_capturable: bool = False
    # True when a step that mixes prompt chunks with decodes may be captured too: the op
    # takes its grid from host maxima only (a captured bucket's), never per-sequence host
    # lengths (engine/mixed_graphs.py; vLLM's cudagraph_mode FULL).
    mixed_graph_capturable: bool = False
    # The most query tokens a sequence may bring and still run as decode rows (each token a
    # row of the decode path with its own causal length: kernels/attention/decode_rows.py);
    # 1: one-token decodes only. Above 1, a verification step of speculative decoding whose
    # every sequence fits runs as a decode step of one row a token, in the decode graph of
    # that many rows (engine/model_runner.py). Where the backend is also not
    # mixed_graph_capturable, the mixed-step graphs capture only steps whose every sequence
    # fits it, each token a decode row (vLLM's MLA backends likewise take spec-decode
    # queries as decode rows).
    decode_rows_max_query_len: int = 1

    def hardware_rule(self, device: DeviceInfo, spec: Any) -> str | None:
        """None if the hardware (and the request) allow this backend, else the reason."""
        return None

    def availability(self, device: DeviceInfo, libraries: LibraryAssumption = "installed"
                     ) -> str | None:
        """None if this build can run it under the library assumption, else the reason."""
        if not self.implemented:
            return f"{self.name} is not implemented in this build of archserve"
        if self.library is None:
            return None
        if libraries == "all":
            return None
        if libraries == "none":
            return f"{self.library} is assumed absent"
        if isinstance(libraries, frozenset):
            return None if self.library in libraries else f"{self.library} is assumed absent"
        return None if library_version(device, self.library) else f"{self.library} is not installed"

    def build_rule(self, device: DeviceInfo, spec: Any) -> str | None:
        """None if this build's implementation handles the request; else the reason. Part of
        availability: a request the hardware rule allows (the ideal) but whose feature
        archserve's kernel lacks (attention sinks, say) is refused here, not there."""
        return None

    def check(self, device: DeviceInfo, spec: Any, libraries: LibraryAssumption = "installed"
              ) -> str | None:
        return (self.hardware_rule(device, spec) or self.availability(device, libraries)
                or (self.build_rule(device, spec) if self.implemented else None))

    def make_impl(self, device: DeviceInfo, spec: Any) -> Any:
        """Build the object that computes the op. Only called after ``check`` passed."""
        raise NotImplementedError(f"{self.name} has no implementation in this build")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def library_version(device: DeviceInfo, name: str) -> str | None:
    """The version of an optional library on this device's toolchain (None: absent)."""
    return device.toolchain.libraries.get(name)


@dataclass
class Rejection:
    backend: str
    reason: str


@dataclass
class Selection:
    """The outcome of one selection: the winner and why every earlier candidate lost."""

    op: str
    backend: Backend
    rejected: list[Rejection] = field(default_factory=list)
    ideal: str | None = None          # winner by hardware rules alone
    forced: bool = False              # chosen by an override

    @property
    def name(self) -> str:
        return self.backend.name


class BackendError(ValueError):
    """An override that cannot run, or an unknown backend name."""


class Registry:
    """Backends by op kind and name, plus each op kind's priority function and fallback."""

    def __init__(self) -> None:
        self._backends: dict[str, dict[str, Backend]] = {op: {} for op in OP_KINDS}
        self._priorities: dict[str, Callable[[DeviceInfo, Any], list[str]]] = {}
        self._fallbacks: dict[str, str] = {}
        self._plugins: set[tuple[str, str]] = set()   # (op, name) registered by entry points
        self._entry_points_loaded = False
        self._loading_plugins = False

    # -- registration -------------------------------------------------------
    def register(self, backend: Backend, *, replace: bool = False) -> Backend:
        if backend.op not in self._backends:
            self._backends[backend.op] = {}
        table = self._backends[backend.op]
        if backend.name in table and not replace:
            raise BackendError(f"{backend.op} backend {backend.name} is already registered")
        table[backend.name] = backend
        if self._loading_plugins:
            self._plugins.add((backend.op, backend.name))
        return backend

    def unregister(self, op: str, name: str) -> None:
        """Remove a backend (a plug-in being unloaded); the fallback cannot be removed."""
        if name == self._fallbacks.get(op):
            raise BackendError(f"{name} is the {op} fallback and cannot be unregistered")
        self._backends[op].pop(name, None)
        self._plugins.discard((op, name))

    def set_priority(self, op: str, fn: Callable[[DeviceInfo, Any], list[str]],
                     fallback: str) -> None:
        self._priorities[op] = fn
        self._fallbacks[op] = fallback

    # -- lookup --------------------------------------------------------------
    def backends(self, op: str) -> dict[str, Backend]:
        self.load_entry_points()
        return self._backends[op]

    def get(self, op: str, name: str) -> Backend:
        table = self.backends(op)
        key = name.strip().upper()
        if key not in table:
            raise BackendError(
                f"unknown {op} backend {name!r}; valid choices: {', '.join(sorted(table))}")
        return table[key]

    def priority(self, op: str, device: DeviceInfo, spec: Any) -> list[str]:
        """The op kind's ordered candidates, with plug-in backends before the fallback."""
        self.load_entry_points()
        ordered = list(self._priorities[op](device, spec))
        fallback = self._fallbacks[op]
        extras = [n for n in self._backends[op]
                  if (op, n) in self._plugins and n not in ordered and n != fallback]
        if fallback in ordered:
            ordered.remove(fallback)
        return ordered + extras + [fallback]

    # -- selection -------------------------------------------------------------
    def select(self, op: str, device: DeviceInfo, spec: Any, *,
               libraries: LibraryAssumption = "installed", override: str | None = None,
               extra_reject: Callable[[Backend], str | None] | None = None) -> Selection:
        """Pick the backend for ``op``; ``override`` is validated alone and never replaced.

        ``extra_reject`` lets the caller demote candidates for runtime reasons (a failed
        warm-up or numerics canary) so they appear in the trace like any other reason.
        """
        ideal = self._first_passing(op, device, spec, lambda b: b.hardware_rule(device, spec))
        if override:
            backend = self.get(op, override)
            reason = backend.check(device, spec, libraries) or (
                extra_reject(backend) if extra_reject else None)
            if reason:
                valid = [n for n, b in self.backends(op).items()
                         if not b.check(device, spec, libraries)]
                raise BackendError(
                    f"{op} backend {backend.name} cannot run here: {reason}. "
                    f"Valid choices on {device.describe()}: {', '.join(valid) or 'none'}")
            return Selection(op, backend, [], ideal, forced=True)

        rejected: list[Rejection] = []
        for name in self.priority(op, device, spec):
            backend = self._backends[op][name]
            reason = backend.check(device, spec, libraries)
            if reason is None and extra_reject is not None:
                reason = extra_reject(backend)
            if reason is None:
                return Selection(op, backend, rejected, ideal)
            rejected.append(Rejection(name, reason))
        fallback = self._backends[op][self._fallbacks[op]]
        raise BackendError(f"no {op} backend can run this request; the fallback "
                           f"{fallback.name} said: {rejected[-1].reason}")

    def ideal(self, op: str, device: DeviceInfo, spec: Any) -> str | None:
        """The first candidate the hardware rules allow, whatever this build holds."""
        return self._first_passing(op, device, spec, lambda b: b.hardware_rule(device, spec))

    def _first_passing(self, op: str, device: DeviceInfo, spec: Any,
                       reject: Callable[[Backend], str | None]) -> str | None:
        for name in self.priority(op, device, spec):
            if reject(self._backends[op][name]) is None:
                return name
        return None

    # -- third parties -------------------------------------------------------
    def load_entry_points(self, entry_points: Iterable[Any] | None = None) -> None:
        """Load plug-ins once. A broken plug-in is logged and skipped, never fatal."""
        if entry_points is None:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        self._loading_plugins = True
        try:
            for ep in entry_points:
                try:
                    target = ep.load()
                    if callable(target):
                        target(self)
                except Exception as exc:  # a plug-in must not take the engine down
                    log.warning("backend plug-in %s failed to load: %s", ep.name, exc)
        finally:
            self._loading_plugins = False


def module_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def override_from_env(op: str, explicit: str | None) -> str | None:
    """An explicit override wins; else ARCHSERVE_<OP>_BACKEND (e.g. ARCHSERVE_ATTENTION_BACKEND)."""
    return explicit or os.environ.get(f"ARCHSERVE_{op.upper()}_BACKEND") or None
