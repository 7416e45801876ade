"""Compile the Triton kernels a Python wrapper launches, for a GPU this machine need not have.

Inside ``compiled_launches(target)`` every ``kernel[grid](...)`` is compiled by Triton's own
compiler for ``target`` (its bundled ptxas included) from the arguments the wrapper really
passes, instead of being launched: the signature comes from the tensors' dtypes and the
scalars (16-byte aligned tensors and multiples of 16 marked divisible, as the launcher
specializes them), the constexprs and launch options as given. So a CPU test reaches the
compiler with exactly the specializations the engine would launch; the interpreter, which runs the
kernels' Python, accepts code the compiler refuses (a constexpr named twice, a non-constexpr
global). The outputs are left unwritten: a wrapper's arithmetic after the launch runs on
garbage, so callers check compilation, not values.

``target`` may be a device profile (a ``DeviceInfo``): then, within the block, every tensor
stands for that profile's GPU (platform/emulation.py's ``compile_target``), so the wrappers
choose the tiles, features and launch options the engine would choose there. An autotuned
kernel launches each config its pruning keeps for the target, as the autotuner would time
them. ``collected_launches`` records the same launches without compiling them, for
``compile_all`` to compile each distinct one once, on several processes.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT, AUTOTUNED, CANDIDATE = "default", "autotuned", "candidate"
_POINTER_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                  torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8",
                  torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
                  torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


@dataclass(frozen=True)
class LaunchSpec:
    """What one launch makes Triton compile: the kernel, its specialization, its launch
    options and the target. Equal specs compile to the same binary."""

    module: str
    name: str
    target: tuple
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    divisible: tuple[int, ...]              # argument indices marked divisible by 16
    options: tuple[tuple[str, Any], ...]
    # DEFAULT: a launch the engine runs; AUTOTUNED: one config of a Triton autotuner
    # (which drops a config over the GPU's resources, and fails on any other error);
    # CANDIDATE: one a start-up tuner times (which drops it on any failure).
    kind: str = field(default="default", compare=False)
    rank: int = field(default=0, compare=False)   # an AUTOTUNED config's place in its list

    def key(self) -> tuple:
        return (self.module, self.name, self.target, self.signature, self.divisible,
                tuple((k, repr(v)) for k, v in self.constexprs), self.options)


@dataclass
class CompiledLaunch:
    kernel: str
    constexprs: dict
    asm: dict = field(repr=False)
    options: dict = field(default_factory=dict)    # the launch options it was given
    shared: int = 0                                # bytes of shared memory per block

    def code(self) -> str:
        return self.asm.get("ptx") or self.asm.get("amdgcn") or ""


def _arg_type(value) -> str:  # noqa: ANN001
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


def _divisible_by_16(value) -> bool:  # noqa: ANN001
    """What Triton's launcher marks ``tt.divisibility = 16``: a tensor whose address is a
    multiple of 16 bytes, an integer that is a multiple of 16 (not a bool). With the mark the
    compiler may vectorise loads and use cp.async, as the launched kernel does."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _unspecialized(param) -> bool:  # noqa: ANN001 - a triton KernelParam
    """A parameter the kernel lists in ``do_not_specialize`` (or for alignment): the
    launcher marks nothing about it."""
    return bool(getattr(param, "do_not_specialize", False)
                or getattr(param, "do_not_specialize_on_alignment", False))


def launch_spec(fn, target: tuple, args: tuple, kwargs: dict, kind: str = DEFAULT,
                rank: int = 0) -> LaunchSpec:  # noqa: ANN001 - a triton JITFunction
    """The spec of ``fn[grid](*args, **kwargs)`` for ``target``, as the launcher builds it."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in _LAUNCH_OPTIONS if name in kwargs}
    values = dict(zip((p.name for p in fn.params), args, strict=False))
    values.update(kwargs)
    signature, constexprs, divisible = {}, {}, []
    for index, param in enumerate(fn.params):
        if param.name not in values:
            if not param.has_default:
                raise TypeError(f"{fn.__name__}: no value for {param.name}")
            values[param.name] = param.default
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = _arg_type(value)
            if _divisible_by_16(value) and not _unspecialized(param):  # as the launcher does
                divisible.append(index)
    return LaunchSpec(fn.fn.__module__, fn.__name__, target, tuple(signature.items()),
                      tuple(constexprs.items()), tuple(divisible),
                      tuple(sorted((k, v) for k, v in options.items() if v is not None)),
                      kind, rank)


def _jit_function(spec: LaunchSpec):  # noqa: ANN202
    return getattr(importlib.import_module(spec.module), spec.name)


def compile_spec(spec: LaunchSpec, fn=None) -> CompiledLaunch:  # noqa: ANN001
    """Compile one spec with Triton (raises what the compiler raises)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = fn or _jit_function(spec)
    attrs = {(index,): [["tt.divisibility", 16]] for index in spec.divisible}
    constexprs = dict(spec.constexprs)
    compiled = triton.compile(ASTSource(fn, dict(spec.signature), constexprs, attrs),
                              target=GPUTarget(*spec.target), options=dict(spec.options))
    return CompiledLaunch(spec.name, constexprs, compiled.asm, dict(spec.options),
                          int(compiled.metadata.shared))


_cache: dict[tuple, CompiledLaunch] = {}


def _compile(fn, target: tuple, args: tuple, kwargs: dict, kind: str = DEFAULT
             ) -> CompiledLaunch:  # noqa: ANN001
    spec = launch_spec(fn, target, args, kwargs, kind)
    if spec.key() not in _cache:
        _cache[spec.key()] = compile_spec(spec, fn)
    return _cache[spec.key()]


def target_of(device) -> tuple:  # noqa: ANN001 - a DeviceInfo
    """The Triton target of a device profile."""
    if device.platform == "rocm":
        return ("hip", device.gcn_arch, 64)
    if device.platform != "cuda":
        raise ValueError(f"{device.id}: Triton compiles for GPUs, not {device.platform}")
    return ("cuda", device.capability.to_int(), 32)


_candidates = []      # open ``candidates()`` blocks


@contextlib.contextmanager
def candidates() -> Iterator[None]:
    """Launches within the block are candidates a start-up tuner times (the engine drops
    one that fails to compile or to fit), not launches the engine must run."""
    _candidates.append(True)
    try:
        yield
    finally:
        _candidates.pop()


@contextlib.contextmanager
def _intercepted(target, record) -> Iterator[None]:  # noqa: ANN001
    """Within the block a launch calls ``record(fn, target, args, kwargs, kind, rank)``
    instead of running; an autotuner launches every config its pruning keeps (``rank``:
    the config's place among them)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from archserve.platform.emulation import compile_target

    tuning = []

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202, ARG001
        record(self, target_tuple, args, kwargs,
               CANDIDATE if _candidates else AUTOTUNED if tuning else DEFAULT,
               tuning[-1] if tuning else 0)

    def autotuned_run(self, *args, **kwargs):  # noqa: ANN001, ANN202
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        try:
            for rank, config in enumerate(self.prune_configs(kwargs)):
                tuning.append(rank)
                try:
                    self.fn.run(*args, **kwargs, **config.all_kwargs())
                finally:
                    tuning.pop()
        finally:
            self.nargs = None

    device = None if isinstance(target, tuple) else target
    target_tuple = target if device is None else target_of(device)
    originals = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = run, autotuned_run
    try:
        with (compile_target(device) if device is not None else contextlib.nullcontext(),
              _UncomputedProducts()):
            yield
    finally:
        JITFunction.run, Autotuner.run = originals


class _UncomputedProducts(TorchDispatchMode):
    """torch's matrix products return uninitialised tensors of their result's shape: their
    inputs are the garbage of uncompiled launches anyway, and a prompt-sized GEMM of a
    wrapper's cuBLAS path (a dequantized weight's) would take seconds on a CPU."""

    PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm",
                          "einsum"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in self.PRODUCTS:
            return func(*args, **kwargs)

        def meta(value):  # noqa: ANN001, ANN202
            return value.to("meta") if isinstance(value, torch.Tensor) else value
        shaped = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
        return torch.empty(shaped.shape, dtype=shaped.dtype)


@contextlib.contextmanager
def compiled_launches(target=("cuda", 90, 32)) -> Iterator[list[CompiledLaunch]]:  # noqa: ANN001
    """Compile (for ``target``: ("cuda", capability, 32), ("hip", "gfx942", 64) or a device
    profile) instead of launching; yields the list of what was compiled, in launch order."""
    launches: list[CompiledLaunch] = []

    def record(fn, target, args, kwargs, kind, rank):  # noqa: ANN001, ANN202, ARG001
        launches.append(_compile(fn, target, args, kwargs, kind))

    with _intercepted(target, record):
        yield launches


@contextlib.contextmanager
def collected_launches(target) -> Iterator[list[LaunchSpec]]:  # noqa: ANN001
    """Record (for ``target``, as ``compiled_launches``) what each launch would compile,
    without compiling; yields the list of specs, in launch order."""
    specs: list[LaunchSpec] = []

    def record(fn, target, args, kwargs, kind, rank):  # noqa: ANN001, ANN202
        specs.append(launch_spec(fn, target, args, kwargs, kind, rank))

    with _intercepted(target, record):
        yield specs


@dataclass
class CompileResult:
    """What compiling one spec gave: its shared memory, or the compiler's error; and the
    CPU time it took (this process's and its ptxas's), whatever else the machine ran."""

    shared: int = 0
    error: str | None = None
    cpu_seconds: float = 0.0


def _cpu_seconds() -> float:
    import os
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _compile_for_result(spec: LaunchSpec) -> CompileResult:
    start = _cpu_seconds()
    try:
        shared = compile_spec(spec).shared
    except Exception as exc:  # noqa: BLE001 - the compiler's refusal is the result
        lines = [line for line in str(exc).splitlines() if line.strip()]
        message = " | ".join(lines[:3] + (lines[-2:] if len(lines) > 5 else []))
        return CompileResult(error=f"{type(exc).__name__}: {message}"[:600],
                             cpu_seconds=_cpu_seconds() - start)
    return CompileResult(shared, None, _cpu_seconds() - start)


def compile_all(specs: list[LaunchSpec], workers: int = 2) -> dict[tuple, CompileResult]:
    """Compile each distinct spec once (``spec.key()``), on ``workers`` processes."""
    unique = {spec.key(): spec for spec in specs}
    if workers <= 1 or len(unique) < 2:
        return {key: _compile_for_result(spec) for key, spec in unique.items()}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the parent holds torch's threads, which a fork would copy half-initialised.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.map(_compile_for_result, unique.values(), chunksize=4)
        return dict(zip(unique, results, strict=True))
