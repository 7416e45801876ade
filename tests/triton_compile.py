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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_POINTER_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                  torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8",
                  torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
                  torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


@dataclass
class CompiledLaunch:
    kernel: str
    constexprs: dict
    asm: dict = field(repr=False)
    options: dict = field(default_factory=dict)    # the launch options it was given

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


_cache: dict[tuple, dict] = {}


def _compile(fn, target: tuple, args: tuple, kwargs: dict) -> CompiledLaunch:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {name: kwargs.pop(name) for name in _LAUNCH_OPTIONS if name in kwargs}
    values = dict(zip((p.name for p in fn.params), args, strict=False))
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
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
                attrs[(index,)] = [["tt.divisibility", 16]]
    key = (fn.__name__, target, tuple(signature.items()), tuple(sorted(attrs)), tuple(sorted(
        (k, repr(v)) for k, v in constexprs.items())), tuple(sorted(options.items())))
    if key not in _cache:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget(*target), options=options)
        _cache[key] = compiled.asm
    return CompiledLaunch(fn.__name__, constexprs, _cache[key], options)


@contextlib.contextmanager
def compiled_launches(target: tuple = ("cuda", 90, 32)) -> Iterator[list[CompiledLaunch]]:
    """Compile (for ``target``: ("cuda", capability, 32) or ("hip", "gfx942", 64)) instead
    of launching; yields the list of what was compiled, in launch order."""
    from triton.runtime.jit import JITFunction

    launches: list[CompiledLaunch] = []

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202, ARG001
        launches.append(_compile(self, target, args, dict(kwargs)))

    original = JITFunction.run
    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original
